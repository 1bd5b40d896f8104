"""``fleetgate up``: gateway + N simulated replicas + in-memory index in one process.

Each simulated replica gets an in-process replica agent that consumes its KV events into the
shared in-memory index and registers it in an in-memory fleet store, which the gateway reads, so
the embedded stack runs the same three index feeds as production, without Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy
from gateway.server import start_site
from gateway.sim_tokenizer import SimPromptTokenizer


@dataclass
class EmbeddedStack:
    """A running embedded stack."""

    url: str
    model: str
    replica_urls: list[str]
    app: web.Application


@contextlib.asynccontextmanager
async def embedded_stack(
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 0,
    model: str = "sim-model",
    profile: str = "expected-ttft",
    usd_per_hour: float = 2.0,
    admin_key: str | None = None,
    sim_speed: float = 1.0,
    sim_profile: str = "h100-llama3-8b",
) -> AsyncIterator[EmbeddedStack]:
    """Start the sims, their agents and the gateway; stop everything on exit."""
    from replica.agent.agent import ReplicaAgent
    from replica.agent.config import AgentConfig
    from replica.fleet_store import MemoryFleetStore
    from replica.sim.fleet import start_sim_fleet
    from routing.index import MemoryBlockIndex

    index = MemoryBlockIndex()
    fleet_store = MemoryFleetStore()
    async with (
        start_sim_fleet(
            replicas, host="127.0.0.1", model=model, speed=sim_speed, profile=sim_profile
        ) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        for handle in fleet.replicas:
            agent = ReplicaAgent(
                AgentConfig(
                    replica_id=f"sim/{handle.index}",
                    engine_url=handle.url,
                    model=model,
                    kv_events_endpoint=handle.kv_events_endpoint,
                    replay_endpoint=handle.kv_replay_endpoint,
                    listen_port=None,
                ),
                index=index,
                fleet=fleet_store,
            )
            await stack.enter_async_context(agent)
        await _wait_registered(fleet_store, replicas)
        config = GatewayConfig(default_profile=profile, admin_key=admin_key, health_interval_s=0.5)
        app = create_app(
            config,
            GatewayPolicy.default(profile=profile, usd_per_hour=usd_per_hour),
            index=index,
            tokenizer=SimPromptTokenizer(),
            fleet_store=fleet_store,
        )
        runner, url = await start_site(app, host, port, config.drain_timeout_s)
        try:
            yield EmbeddedStack(url, model, fleet.urls, app)
        finally:
            await runner.cleanup()


async def _wait_registered(fleet_store: Any, count: int, timeout_s: float = 15.0) -> None:
    """Wait until every agent has registered its replica (their first scrape)."""
    async with asyncio.timeout(timeout_s):
        while len(await fleet_store.list_replicas()) < count:
            await asyncio.sleep(0.05)
