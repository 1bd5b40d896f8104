"""A stalled engine: its server answers /health, but its EngineCore (or the GPU under it) is
hung, and the requests it holds never move. vLLM's /health says 200 throughout, so the agent
watches the engine's step count (``vllm:iteration_tokens_total``) instead: holding requests
with no step finished for ``stall_after_s`` is reported down until a step comes again (live
review of ``fleetgate replica run``: requests hung on a SIGSTOPped EngineCore while the
gateway and the agent called it healthy).

The engine is a stand-in aiohttp app on a real socket serving vLLM's metric names: no real
engine can be hung on cue (SIGSTOP of a real EngineCore is what the review did by hand).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from aiohttp.test_utils import TestServer

from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import MemoryFleetStore
from routing.index import MemoryBlockIndex
from routing.types import ReplicaId
from tests.support.polling import wait_until

RID = ReplicaId("pool/stall")


@dataclass
class _Engine:
    running: int = 1
    steps: int | None = 10


@asynccontextmanager
async def _agent_beside(engine: _Engine) -> AsyncIterator[tuple[ReplicaAgent, MemoryFleetStore]]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.Response:
        lines = [f"vllm:num_requests_running {engine.running}", "vllm:num_requests_waiting 0"]
        if engine.steps is not None:
            lines.append(f'vllm:iteration_tokens_total_count{{engine="0"}} {engine.steps}')
        return web.Response(text="\n".join(lines) + "\n")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    fleet = MemoryFleetStore()
    async with TestServer(app) as server:
        agent = ReplicaAgent(
            AgentConfig(replica_id=RID, engine_url=str(server.make_url("")).rstrip("/"),
                        model="m", listen_port=None, scrape_interval_s=0.05,
                        heartbeat_ttl_s=2.0, stall_after_s=0.5),
            index=MemoryBlockIndex(), fleet=fleet,
        )
        await agent.start()
        try:
            yield agent, fleet
        finally:
            await agent.stop()


async def _registered_healthy(fleet: MemoryFleetStore) -> bool | None:
    states = {s.replica_id: s for s in await fleet.list_replicas()}
    return states[RID].healthy if RID in states else None


async def test_an_engine_holding_requests_without_a_step_is_reported_down_until_it_moves() -> None:
    engine = _Engine(running=1, steps=10)
    async with _agent_beside(engine) as (agent, fleet):
        await wait_until(lambda: agent.stalled, "the agent finds the engine stalled")
        assert agent.engine_up  # /health still answers: only the stall says down
        await wait_until(
            lambda: _registration_says(fleet, False), "the registration says down"
        )
        engine.steps = 11  # a step finished: the engine moves again
        await wait_until(lambda: not agent.stalled, "the stall ends with the next step")
        await wait_until(
            lambda: _registration_says(fleet, True), "the registration says up again"
        )


async def test_an_idle_engine_or_one_without_the_step_count_never_stalls() -> None:
    for engine in (_Engine(running=0, steps=10), _Engine(running=3, steps=None)):
        async with _agent_beside(engine) as (agent, fleet):
            await wait_until(
                lambda: _registration_says(fleet, True), "registered as up"
            )
            # Well past stall_after_s (0.5 s) of unchanged readings: still up.
            for _ in range(30):
                await agent.scrape_once()
            await asyncio.sleep(1.0)
            assert not agent.stalled
            assert await _registered_healthy(fleet) is True


async def _registration_says(fleet: MemoryFleetStore, healthy: bool) -> bool:
    return await _registered_healthy(fleet) is healthy
