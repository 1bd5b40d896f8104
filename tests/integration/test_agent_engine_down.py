"""An agent whose engine went down stops vouching for its blocks: they stop matching.

Found by ``bench.chaos``: the agent kept heart-beating the index while its engine was dead, so
the dead replica's entries kept matching for the whole outage (routing, last-resort routing
included, would score it on blocks nobody holds).
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import aiohttp
import pytest

from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import MemoryFleetStore
from replica.sim.fleet import start_sim_fleet
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import RedisBlockIndex
from tests.support.polling import wait_until
from tests.support.redis_server import free_port

pytestmark = pytest.mark.redis

MODEL = "sim-model"
BLOCK = 16
PROMPT = list(range(1000, 1000 + 4 * BLOCK))  # four full blocks


async def test_a_dead_engines_blocks_stop_matching_once_its_heartbeat_expires(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    index = RedisBlockIndex(redis_url, key_prefix=f"down{free_port()}", timeout_s=1.0)
    chain = hash_token_blocks(PROMPT, BLOCK, chain_seed(MODEL, None, None))
    async with AsyncExitStack() as stack:
        stack.push_async_callback(index.close)
        fleet_cm = start_sim_fleet(1, model=MODEL, speed=1000.0, block_size=BLOCK)
        fleet = await fleet_cm.__aenter__()
        (handle,) = fleet.replicas
        agent = ReplicaAgent(
            AgentConfig(
                replica_id="pool/r0",
                engine_url=handle.url,
                model=MODEL,
                kv_events_endpoint=handle.kv_events_endpoint,
                replay_endpoint=handle.kv_replay_endpoint,
                listen_port=None,
                scrape_interval_s=0.1,
                heartbeat_ttl_s=1.0,
            ),
            index=index,
            fleet=MemoryFleetStore(),
        )
        await stack.enter_async_context(agent)
        await wait_until(lambda: agent.engine_up, "the agent sees its engine up", timeout_s=15)
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
            async with http.post(f"{handle.url}/v1/completions", json=body) as resp:
                assert resp.status == 200

        async def matched() -> int:
            return (await index.match(chain)).get("pool/r0", 0)

        async def indexed() -> bool:
            return await matched() == 4

        await wait_until(indexed, "the prompt's blocks are indexed on the replica", timeout_s=15)
        await fleet_cm.__aexit__(None, None, None)  # the engine dies

        async def gone() -> bool:
            return await matched() == 0

        await wait_until(lambda: not agent.engine_up, "the agent sees its engine down", 15)
        await wait_until(gone, "the dead engine's blocks stop matching", timeout_s=15)
        # ... and says so in its log, where an SRE looks first.
        assert any(
            "health checks in a row: reported down" in r.getMessage()
            and r.levelname == "WARNING"
            for r in caplog.records
        )
