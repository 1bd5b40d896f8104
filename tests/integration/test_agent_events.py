"""The replica agent against a real ZMQ KV-event publisher and a real Redis.

Events are produced by ``replica.kv_events.KVEventPublisher`` (wire-compatible with vLLM's), sent
over real TCP sockets, decoded by the agent and written to a real ``RedisBlockIndex``; each test
then checks what a gateway would see: ``index.match`` of the chain fleetgate computes for the
same tokens. Real-engine behaviour is covered by tests/e2e.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import RedisFleetStore
from replica.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    running_publisher,
)
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import RedisBlockIndex
from tests.support.polling import wait_until
from tests.support.redis_server import free_port

pytestmark = pytest.mark.redis

BS = 4  # small blocks keep the token lists readable; the agent reads block_size per event
MODEL = "tiny"


def stored(
    engine_hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    lora: str | None = None,
    extra_keys: list[tuple[object, ...] | None] | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=engine_hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None if lora is None else 1,
        medium="GPU",
        lora_name=lora,
        extra_keys=extra_keys,
    )


def chain(tokens: list[int], adapter: str | None = None, salt: str | None = None) -> list[int]:
    return hash_token_blocks(tokens, BS, chain_seed(MODEL, adapter, salt))


PROMPT = list(range(100, 112))  # three blocks of four tokens


@pytest.fixture
async def index(redis_url: str) -> AsyncIterator[RedisBlockIndex]:
    prefix = f"agent{free_port()}"  # a private key space per test
    idx = RedisBlockIndex(redis_url, key_prefix=prefix, timeout_s=1.0)
    yield idx
    await idx.close()


def make_config(endpoint: str, replay: str | None = None, **kw: object) -> AgentConfig:
    return AgentConfig(
        replica_id=kw.pop("replica_id", "pool/r0"),  # type: ignore[arg-type]
        # Nothing listens here: these tests are about events, the engine is "down".
        engine_url=f"http://127.0.0.1:{free_port()}",
        model=MODEL,
        kv_events_endpoint=endpoint,
        replay_endpoint=replay,
        listen_port=None,
        scrape_interval_s=0.05,
        heartbeat_ttl_s=5.0,
        resync_interval_s=0.05,
        **kw,  # type: ignore[arg-type]
    )


async def handshake(publisher: KVEventPublisher, agent: ReplicaAgent) -> None:
    """Publish empty batches until the agent receives one (ZMQ subscriptions join late)."""
    start = agent.batches_applied

    async def received() -> bool:
        publisher.publish([])
        await asyncio.sleep(0.02)
        return agent.batches_applied > start

    await wait_until(received, "the agent to receive a first batch")


@pytest.mark.parametrize("legacy", [False, True], ids=["map-events", "legacy-array-events"])
async def test_stored_and_removed_events_reach_the_index(
    index: RedisBlockIndex, legacy: bool
) -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv", legacy_array_format=legacy)
    config = make_config(publisher.endpoint)
    async with running_publisher(publisher), ReplicaAgent(config, index=index) as agent:
        await handshake(publisher, agent)
        # Two events, as vLLM sends them: a root event of two blocks, then a child block.
        publisher.publish([stored([11, 12], PROMPT[:8])])
        publisher.publish([stored([13], PROMPT[8:], parent=12)])
        target = chain(PROMPT)
        await wait_until(
            lambda: _matches(index, target, {"pool/r0": 3}), "three blocks to match"
        )
        publisher.publish([BlockRemoved(block_hashes=[13], medium="GPU")])
        await wait_until(lambda: _matches(index, target, {"pool/r0": 2}), "removal applied")

        # The agent counts an event once its index write has returned: a reader of the index can
        # see the write before the agent's task resumes to count it, so wait for the count too.
        def removed() -> float:
            return agent.metrics.value("fleetgate_agent_events_applied_total", type="BlockRemoved")

        await wait_until(lambda: removed() >= 1, "the BlockRemoved event to be counted")
        assert removed() == 1


async def _matches(index: RedisBlockIndex, target: list[int], expected: dict[str, int]) -> bool:
    return await index.match(target) == expected


async def test_adapter_and_cache_salt_fold_into_the_chain(index: RedisBlockIndex) -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv")
    async with running_publisher(publisher), ReplicaAgent(
        make_config(publisher.endpoint), index=index
    ) as agent:
        await handshake(publisher, agent)
        # vLLM 0.32 shape: extra_keys per block, (lora_name, cache_salt) on the first only.
        publisher.publish([
            stored([21, 22], PROMPT[:8], lora="ad-1", extra_keys=[("ad-1", "tenant-a"), ("ad-1",)])
        ])
        salted = chain(PROMPT[:8], adapter="ad-1", salt="tenant-a")
        await wait_until(lambda: _matches(index, salted, {"pool/r0": 2}), "adapter+salt chain")
        assert await index.match(chain(PROMPT[:8])) == {}
        assert await index.match(chain(PROMPT[:8], adapter="ad-1")) == {}
        assert await index.match(chain(PROMPT[:8], salt="tenant-a")) == {}


async def test_all_blocks_cleared_retires_the_epoch(index: RedisBlockIndex) -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv")
    async with running_publisher(publisher), ReplicaAgent(
        make_config(publisher.endpoint), index=index
    ) as agent:
        await handshake(publisher, agent)
        publisher.publish([stored([31, 32, 33], PROMPT)])
        await wait_until(lambda: _matches(index, chain(PROMPT), {"pool/r0": 3}), "stored")
        first_epoch = agent.applier.epoch
        publisher.publish([AllBlocksCleared()])
        await wait_until(lambda: _matches(index, chain(PROMPT), {}), "cleared")
        assert agent.applier.epoch != first_epoch
        assert agent.metrics.value(
            "fleetgate_agent_epoch_retirements_total", reason="cleared"
        ) == 1
        # The new epoch accepts new blocks.
        publisher.publish([stored([34], PROMPT[:4])])
        await wait_until(lambda: _matches(index, chain(PROMPT), {"pool/r0": 1}), "re-stored")


async def test_publisher_restart_is_detected_by_sequence_reset(index: RedisBlockIndex) -> None:
    port = free_port()
    # "*" makes the publisher bind, as vLLM does with its default endpoint.
    first = KVEventPublisher(f"tcp://*:{port}", topic="kv")
    config = make_config(f"tcp://127.0.0.1:{port}")
    async with ReplicaAgent(config, index=index) as agent:
        async with running_publisher(first):
            await handshake(first, agent)
            # Move the stream well past where a new process starts: the second publisher's
            # handshake emits a batch every 20 ms until the subscriber reconnects, and its
            # numbers must stay below this one's or the restart looks like a plain gap.
            for _ in range(1000):
                first.publish([])
            first.publish([stored([41, 42, 43], PROMPT)])
            await wait_until(lambda: _matches(index, chain(PROMPT), {"pool/r0": 3}), "stored")
        epoch_before = agent.applier.epoch
        # A new engine process on the same port numbers its batches from 0 again.
        second = await _bind_when_free(f"tcp://*:{port}")
        async with running_publisher(second):
            await handshake(second, agent)
        assert agent.applier.epoch != epoch_before
        assert await index.match(chain(PROMPT)) == {}
        assert agent.metrics.value(
            "fleetgate_agent_epoch_retirements_total", reason="restart"
        ) == 1


async def _bind_when_free(endpoint: str) -> KVEventPublisher:
    """ZMQ releases a closed socket's port in its I/O thread, shortly after ``close``."""
    import zmq

    deadline = time.monotonic() + 10
    while True:
        try:
            return KVEventPublisher(endpoint, topic="kv")
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def test_gap_is_filled_from_the_replay_socket(index: RedisBlockIndex) -> None:
    # The agent listens on a port where nothing publishes, so it sees only what the test hands
    # it as "received" and must fetch the rest from the publisher's real replay socket.
    publisher = KVEventPublisher(
        "tcp://127.0.0.1:*", topic="kv", replay_endpoint="tcp://127.0.0.1:*"
    )
    config = make_config(f"tcp://127.0.0.1:{free_port()}", replay=publisher.replay_endpoint)
    batches = [
        [stored([51], PROMPT[:4])],
        [stored([52], PROMPT[4:8], parent=51)],
        [stored([53], PROMPT[8:], parent=52)],
        [stored([54], [7, 7, 7, 7])],
    ]
    async with running_publisher(publisher), ReplicaAgent(config, index=index) as agent:
        sent = [publisher.publish(events) for events in batches]
        assert sent == [0, 1, 2, 3]
        epoch = agent.applier.epoch
        from replica.kv_events import make_batch

        await agent.handle_batch(0, make_batch(batches[0], ts=time.time()))
        await agent.handle_batch(3, make_batch(batches[3], ts=time.time()))  # 1 and 2 missed
        assert await index.match(chain(PROMPT)) == {"pool/r0": 3}
        assert await index.match(chain([7, 7, 7, 7])) == {"pool/r0": 1}
        assert agent.applier.epoch == epoch
        assert agent.metrics.value("fleetgate_agent_replays_total", outcome="ok") == 1
        assert agent.metrics.value("fleetgate_agent_event_gaps_total") == 1


async def test_an_agent_started_beside_a_running_engine_learns_what_it_already_holds(
    index: RedisBlockIndex,
) -> None:
    """A restarted agent's first batch is not the engine's first: every earlier batch the
    replay socket still buffers is applied before it, so the index is not cold for blocks the
    engine stored while no agent listened (the chaos bench's agent-killed fault)."""
    publisher = KVEventPublisher(
        "tcp://127.0.0.1:*", topic="kv", replay_endpoint="tcp://127.0.0.1:*"
    )
    config = make_config(publisher.endpoint, replay=publisher.replay_endpoint)
    async with running_publisher(publisher):
        # The engine ran before the agent: a chain and a removal nobody received.
        publisher.publish([stored([71, 72], PROMPT[:8])])
        publisher.publish([stored([73], PROMPT[8:], parent=72)])
        publisher.publish([stored([74], [9, 9, 9, 9])])
        publisher.publish([BlockRemoved(block_hashes=[74], medium="GPU")])
        async with ReplicaAgent(config, index=index) as agent:
            await handshake(publisher, agent)
            assert await index.match(chain(PROMPT)) == {"pool/r0": 3}
            assert await index.match(chain([9, 9, 9, 9])) == {}
            assert agent.metrics.value("fleetgate_agent_replays_total", outcome="ok") == 1
            # Nothing was lost: the epoch the agent started with is still the live one.
            assert agent.metrics.value(
                "fleetgate_agent_epoch_retirements_total", reason="gap"
            ) == 0


async def test_the_catch_up_takes_a_buffer_longer_than_a_sockets_high_water_mark(
    index: RedisBlockIndex,
) -> None:
    """2,500 batches before the agent started: more than a ZMQ socket queues by default (1,000),
    past which a ROUTER drops the rest of a reply, its end marker included."""
    publisher = KVEventPublisher(
        "tcp://127.0.0.1:*", topic="kv", replay_endpoint="tcp://127.0.0.1:*"
    )
    config = make_config(publisher.endpoint, replay=publisher.replay_endpoint)
    prompts = [[5000 + 4 * i + k for k in range(BS)] for i in range(2500)]
    async with running_publisher(publisher):
        for i, tokens in enumerate(prompts):
            publisher.publish([stored([100_000 + i], tokens)])
        async with ReplicaAgent(config, index=index) as agent:
            await handshake(publisher, agent)
            for i in (0, 999, 1000, 2499):
                assert await index.match(chain(prompts[i])) == {"pool/r0": 1}, i


async def test_gap_without_replay_retires_the_epoch(index: RedisBlockIndex) -> None:
    from replica.kv_events import make_batch

    config = make_config(f"tcp://127.0.0.1:{free_port()}")
    async with ReplicaAgent(config, index=index) as agent:
        epoch = agent.applier.epoch
        await agent.handle_batch(0, make_batch([stored([61, 62], PROMPT[:8])], ts=time.time()))
        assert await index.match(chain(PROMPT)) == {"pool/r0": 2}
        # Batch 1 is lost. Batch 2 continues the chain from a block the agent never saw.
        await agent.handle_batch(
            2, make_batch([stored([63], PROMPT[8:], parent=99)], ts=time.time())
        )
        assert agent.applier.epoch != epoch
        assert await index.match(chain(PROMPT)) == {}
        assert agent.metrics.value(
            "fleetgate_agent_epoch_retirements_total", reason="gap"
        ) == 1
        # The stream goes on in the new epoch.
        await agent.handle_batch(3, make_batch([stored([64], PROMPT[:4])], ts=time.time()))
        assert await index.match(chain(PROMPT)) == {"pool/r0": 1}


async def test_redis_outage_then_resync(redis_server) -> None:  # type: ignore[no-untyped-def]
    index = RedisBlockIndex(redis_server.url, key_prefix="outage", timeout_s=0.5)
    fleet = RedisFleetStore(redis_server.url, key_prefix="outage:", socket_timeout_s=0.5)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv")
    config = make_config(publisher.endpoint)
    a, b = PROMPT[:8], [9, 9, 9, 9, 8, 8, 8, 8]
    try:
        async with running_publisher(publisher), ReplicaAgent(
            config, index=index, fleet=fleet
        ) as agent:
            await handshake(publisher, agent)
            publisher.publish([stored([71, 72], a)])
            await wait_until(lambda: _matches(index, chain(a), {"pool/r0": 2}), "a stored")
            await wait_until(_listed(fleet, agent), "replica registered")
            epoch_before = agent.applier.epoch

            redis_server.stop()
            applied = agent.batches_applied
            publisher.publish([stored([73, 74], b)])
            publisher.publish([BlockRemoved(block_hashes=[71, 72], medium="GPU")])
            await wait_until(lambda: agent.batches_applied >= applied + 2, "events during outage")
            await wait_until(lambda: agent.applier.dirty, "agent notices the outage")
            assert agent.metrics.value("fleetgate_agent_redis_errors_total") >= 1

            redis_server.start()  # same port, empty: everything must be re-recorded
            await wait_until(lambda: not agent.applier.dirty, "resync after the outage")
            assert await index.match(chain(b)) == {"pool/r0": 2}
            assert await index.match(chain(a)) == {}
            assert agent.applier.epoch != epoch_before
            assert agent.metrics.value(
                "fleetgate_agent_epoch_retirements_total", reason="resync"
            ) == 1
            await wait_until(_listed(fleet, agent), "replica registered again with new epoch")
        assert [s.replica_id for s in await fleet.list_replicas()] == []  # deregistered on stop
    finally:
        await index.close()
        await fleet.close()


def _listed(fleet: RedisFleetStore, agent: ReplicaAgent) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            states = await fleet.list_replicas()
        except Exception:
            return False
        return any(
            s.replica_id == agent.replica and s.epoch == agent.applier.epoch for s in states
        )

    return check


async def test_stop_finishes_even_if_a_loop_swallows_its_cancellation() -> None:
    """Some client libraries turn a cancellation into their own error; stop() must not hang."""
    from routing.index import MemoryBlockIndex

    config = make_config(f"tcp://127.0.0.1:{free_port()}")
    agent = ReplicaAgent(config, index=MemoryBlockIndex())
    swallowed = asyncio.Event()

    async def stubborn_health_probe() -> bool:
        try:
            await asyncio.Event().wait()  # blocks until cancelled
        except asyncio.CancelledError:
            swallowed.set()  # ...and carries on as if the probe had failed
        return False

    agent.scraper.healthy = stubborn_health_probe  # type: ignore[method-assign]
    await agent.start()
    await asyncio.wait_for(agent.stop(), timeout=30)
    assert swallowed.is_set()


async def test_an_agent_that_leaves_the_fleet_retires_its_blocks(index: RedisBlockIndex) -> None:
    """Stopped for good (deregistered), the agent retires its epoch: gateways forget the
    replica's blocks at once (the mirrored index deletes them; lookup mode's expire with their
    TTL), instead of keeping them until its heartbeat lapses."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv")
    config = make_config(publisher.endpoint)
    target = chain(PROMPT)
    async with running_publisher(publisher):
        agent = ReplicaAgent(config, index=index)
        await agent.start()
        try:
            await handshake(publisher, agent)
            publisher.publish([stored([11, 12, 13], PROMPT)])
            await wait_until(lambda: _matches(index, target, {"pool/r0": 3}), "blocks indexed")
        finally:
            await agent.stop()
    assert await index.match(target) == {}
    assert (await index.stats()).replicas == 0
