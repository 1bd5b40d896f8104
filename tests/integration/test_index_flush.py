"""Redis loses the index (``FLUSHALL``): agents notice and re-publish, gateways' mirrors rebuild.

Issue 15's chaos finding: agents never noticed a flush, so the index stayed cold until engines
stored the same blocks again. Now an agent's heartbeat learns that Redis forgot its epoch, and
the agent declares a new epoch and re-records every block its engine holds. Both index modes run
against a real Redis, a simulated engine and a real agent; no request is sent after the flush,
so a match afterwards can only come from the agent's re-publication.

With traffic, a confirmed write usually reaches the flushed Redis before the agent's next
heartbeat and re-creates the replica's state under the old epoch, so the heartbeat no longer
notices. In mirror mode (the default) that write itself now tells the agent (``IndexLost``):
the last case sends a request right after the flush with a heartbeat 10 s away.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import aiohttp
import pytest
import redis.asyncio as aioredis

from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import MemoryFleetStore
from replica.sim.fleet import start_sim_fleet
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import MirrorBlockIndex, RedisBlockIndex
from tests.support.polling import wait_until

pytestmark = pytest.mark.redis

MODEL = "sim-model"
BLOCK = 16
PROMPT = list(range(2000, 2000 + 4 * BLOCK))  # four full blocks
CHAIN = hash_token_blocks(PROMPT, BLOCK, chain_seed(MODEL, None, None))
HELD = {"pool/r0": 4}
#: A second prompt, sent right after the flush in the "write after flush" case.
LATER = list(range(3000, 3000 + 2 * BLOCK))
LATER_CHAIN = hash_token_blocks(LATER, BLOCK, chain_seed(MODEL, None, None))


@pytest.mark.parametrize(
    ("mode", "write_after_flush"),
    [("lookup", False), ("mirror", False), ("mirror", True)],
    ids=["lookup", "mirror", "mirror-write-after-flush"],
)
async def test_agents_republish_and_gateways_rebuild_after_a_flush(
    redis_server, mode: str, write_after_flush: bool  # type: ignore[no-untyped-def]
) -> None:
    async with AsyncExitStack() as stack:
        gateway_index: RedisBlockIndex | MirrorBlockIndex
        if mode == "lookup":
            gateway_index = RedisBlockIndex(redis_server.url, key_prefix="flush", timeout_s=1.0)
        else:
            gateway_index = MirrorBlockIndex(
                redis_server.url, key_prefix="flush", timeout_s=1.0, check_interval_s=0.1
            )
            await gateway_index.start()
        # The agent builds its own index from the config, as `fleetgate agent --index-mode`
        # does: in lookup mode it once wrote the mirror's layout, which no lookup gateway reads.
        agent_index = None
        stack.push_async_callback(gateway_index.close)
        fleet = await stack.enter_async_context(
            start_sim_fleet(1, model=MODEL, speed=1000.0, block_size=BLOCK)
        )
        (handle,) = fleet.replicas
        agent = ReplicaAgent(
            AgentConfig(
                replica_id="pool/r0",
                engine_url=handle.url,
                model=MODEL,
                kv_events_endpoint=handle.kv_events_endpoint,
                replay_endpoint=handle.kv_replay_endpoint,
                index_url=redis_server.url,
                index_key_prefix="flush",
                index_mode=mode,
                listen_port=None,
                scrape_interval_s=0.1,
                # Heartbeats every 10 s in the write-after-flush case: the write comes first.
                heartbeat_ttl_s=30.0 if write_after_flush else 1.0,
                resync_interval_s=0.05,
            ),
            index=agent_index,
            fleet=MemoryFleetStore(),
        )
        await stack.enter_async_context(agent)
        await wait_until(lambda: agent.engine_up, "the agent sees its engine up", timeout_s=15)

        async def complete(prompt: list[int]) -> None:
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                async with http.post(f"{handle.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200

        await complete(PROMPT)

        async def held() -> bool:
            return await gateway_index.match(CHAIN) == HELD

        await wait_until(held, "the engine's blocks to reach the gateway's index")
        epoch_before = agent.applier.epoch

        client = aioredis.Redis.from_url(redis_server.url)
        try:
            await client.flushall()
        finally:
            await client.aclose()
        if write_after_flush:
            await complete(LATER)

        if mode == "lookup":
            assert await gateway_index.match(CHAIN) == {}  # the flush emptied the shared index
        else:

            async def rebuilt() -> bool:
                return (await gateway_index.stats()).extra["rebuilds"] >= 1

            await wait_until(rebuilt, "the mirror to notice the flush and rebuild")
        await wait_until(held, "the agent to re-publish its engine's blocks", timeout_s=15)
        assert agent.metrics.value("fleetgate_agent_index_lost_total") >= 1
        # Behind while it re-records, caught up once the resync ran (the failover review: the
        # applied-events counter and the lag looked healthy through the outage).
        await wait_until(
            lambda: agent.metrics.value("fleetgate_agent_index_behind") == 0.0,
            "the agent to say the index caught up",
        )
        assert agent.applier.epoch != epoch_before
        if write_after_flush:
            assert await gateway_index.match(LATER_CHAIN) == {"pool/r0": 2}
