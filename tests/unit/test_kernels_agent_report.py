"""The agent publishes the kernel plugins its engine reported (``ReplicaState.kernel_plugins``)."""

from __future__ import annotations

import json

from replica.agent import AgentConfig, ReplicaAgent
from replica.agent.kernels import KernelReportReader, build_kernel_reader
from replica.agent.scrape import EngineSnapshot
from replica.fleet_store import MemoryFleetStore, state_from_json, state_to_json

PLUGIN = "replica.kernels.vllm_plugin"


class FakeRedis:
    """``hgetall`` of one hash, or the error a test sets."""

    def __init__(self, hashes: dict[str, dict[bytes, bytes]]) -> None:
        self.hashes = hashes
        self.error: Exception | None = None
        self.closed = False

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        if self.error is not None:
            raise self.error
        return dict(self.hashes.get(key, {}))

    async def aclose(self) -> None:
        self.closed = True


class UpScraper:
    async def healthy(self) -> bool:
        return True

    async def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(models=("tiny",), read_at=5.0)

    async def close(self) -> None:
        pass


async def test_reader_reads_the_plugins_hash_and_says_none_when_redis_is_down() -> None:
    fake = FakeRedis({"fg:replica:r0:kernels": {PLUGIN.encode(): b"0.1.0"}})
    reader = KernelReportReader("redis://unused", "fg:", "r0", client=fake)
    assert reader.key == "fg:replica:r0:kernels"
    assert await reader.read() == {PLUGIN: "0.1.0"}
    fake.error = ConnectionError("down")
    assert await reader.read() is None
    fake.error = None
    fake.hashes.clear()
    assert await reader.read() == {}  # the engine lists no plugin (or has not started)
    await reader.close()
    assert fake.closed


def test_no_reader_for_an_in_memory_fleet() -> None:
    assert build_kernel_reader(None, "fg:", "r0") is None
    assert build_kernel_reader("memory://", "fg:", "r0") is None
    assert build_kernel_reader("redis://localhost:6379", "fg:", "r0") is not None


async def test_agent_state_carries_the_engine_kernels_and_keeps_them_through_an_outage() -> None:
    agent = ReplicaAgent(
        AgentConfig(replica_id="r0", engine_url="http://127.0.0.1:1", model="tiny",
                    listen_port=None),
        fleet=MemoryFleetStore(),
    )
    fake = FakeRedis({"fg:replica:r0:kernels": {PLUGIN.encode(): b"0.1.0"}})
    agent.kernel_reader = KernelReportReader("redis://unused", "fg:", "r0", client=fake)
    agent.scraper = UpScraper()  # type: ignore[assignment]
    assert agent.state().kernel_plugins == {}
    await agent.scrape_once()
    state = agent.state()
    assert state.kernel_plugins == {PLUGIN: "0.1.0"}
    # What the gateway reads back from the fleet store (and shows in /admin/replicas).
    assert json.loads(state_to_json(state))["kernel_plugins"] == {PLUGIN: "0.1.0"}
    assert state_from_json(state_to_json(state)).kernel_plugins == {PLUGIN: "0.1.0"}
    # Redis unreadable for a moment: the last known kernels stay published.
    fake.error = ConnectionError("down")
    await agent.scrape_once()
    assert agent.state().kernel_plugins == {PLUGIN: "0.1.0"}


async def test_agent_with_a_redis_fleet_builds_a_reader_on_the_fleet_prefix() -> None:
    agent = ReplicaAgent(
        AgentConfig(replica_id="pod-7", engine_url="http://127.0.0.1:1", model="tiny",
                    fleet_url="redis://127.0.0.1:1", fleet_key_prefix="prod:", listen_port=None),
        fleet=MemoryFleetStore(),
    )
    assert agent.kernel_reader is not None
    assert agent.kernel_reader.key == "prod:replica:pod-7:kernels"
    await agent.kernel_reader.close()


def test_a_known_kernel_set_read_as_none_is_kept_a_while() -> None:
    # Redis lost the key (a restart without persistence): the plugin writes it again within a
    # third of its TTL; published at once, the gap sent kernel-gated requests to 503.
    from replica.agent.agent import KERNELS_GONE_AFTER_S

    agent = ReplicaAgent(
        AgentConfig(replica_id="r0", engine_url="http://127.0.0.1:1", model="tiny",
                    listen_port=None),
        fleet=MemoryFleetStore(),
    )
    agent._note_kernels({PLUGIN: "0.1.0"}, now=100.0)
    agent._note_kernels({}, now=101.0)
    agent._note_kernels({}, now=100.0 + KERNELS_GONE_AFTER_S)
    assert agent.state().kernel_plugins == {PLUGIN: "0.1.0"}
    agent._note_kernels({PLUGIN: "0.1.0"}, now=120.0)  # back: the wait starts again next time
    agent._note_kernels({}, now=121.0)
    agent._note_kernels({}, now=121.0 + KERNELS_GONE_AFTER_S)  # gone for good
    assert agent.state().kernel_plugins == {}


def test_the_agent_says_when_the_index_is_behind_its_engine() -> None:
    agent = ReplicaAgent(
        AgentConfig(replica_id="r0", engine_url="http://127.0.0.1:1", model="tiny",
                    listen_port=None),
        fleet=MemoryFleetStore(),
    )
    assert agent.metrics.value("fleetgate_agent_index_behind") == 0.0
    agent.applier.dirty = True  # a Redis write failed: a resync must re-record
    assert agent.metrics.value("fleetgate_agent_index_behind") == 1.0
