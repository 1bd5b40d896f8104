"""``fleetgate up``: gateway + N simulated replicas + in-memory index in one process.

Each simulated replica gets an in-process replica agent that consumes its KV events into the
shared in-memory index and registers it in an in-memory fleet store, which the gateway reads, so
the embedded stack runs the same three index feeds as production, without Redis.

With ``adapters > 0`` the gateway also runs the LoRA adapter registry (placement in memory) over a
catalog of that many public demo adapters (``demo-lora-0``, …): the first request for one loads it
on the replica it is routed to, through the sims' runtime LoRA API, as with vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml
from aiohttp import web

from gateway.adapters import AdapterSetup
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, PoolSpeeds
from gateway.server import start_site
from gateway.sim_tokenizer import SimPromptTokenizer
from routing.config import parse_policy
from routing.policies.registry import DEFAULT_PROFILE

if TYPE_CHECKING:
    from replica.fleet_store import FleetStore

#: Names of the demo adapters ``fleetgate up --adapters N`` registers.
DEMO_ADAPTER_PREFIX = "demo-lora-"


@dataclass
class EmbeddedStack:
    """A running embedded stack."""

    url: str
    model: str
    replica_urls: list[str]
    app: web.Application
    #: Demo adapters in the catalog (empty unless started with ``adapters``).
    adapters: list[str] = field(default_factory=list)
    #: The agents' own ``/metrics`` base URLs, one per replica (Prometheus scrapes them too).
    agent_urls: list[str] = field(default_factory=list)


def demo_adapter_setup(
    model: str, replica_urls: list[str], count: int, max_loras: int, max_cpu_loras: int
) -> AdapterSetup:
    """A registry setup whose catalog holds ``count`` public demo adapters of ``model``.

    The pool is named like the agents' registrations (``default``) so its slot counts apply.
    """
    doc = {
        "version": 1,
        "replica_pools": [
            {
                "name": "default",
                "replicas": replica_urls,
                "max_loras": max_loras,
                "max_cpu_loras": max_cpu_loras,
            }
        ],
        "models": [{"name": model, "pools": ["default"]}],
        "adapters": [
            {
                "name": f"{DEMO_ADAPTER_PREFIX}{i}",
                "base_model": model,
                "source": f"/adapters/demo/{DEMO_ADAPTER_PREFIX}{i}",
                "rank": 8,
                "size_mb": 64,
                "public": True,
            }
            for i in range(count)
        ],
    }
    return AdapterSetup(policy=parse_policy(yaml.safe_dump(doc), "<fleetgate up --adapters>"))


@contextlib.asynccontextmanager
async def embedded_stack(
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 0,
    model: str = "sim-model",
    profile: str = DEFAULT_PROFILE,
    usd_per_hour: float | None = None,
    admin_key: str | None = None,
    sim_speed: float = 1.0,
    sim_profile: str = "h100-llama3-8b",
    adapters: int = 0,
    max_loras: int | None = None,
) -> AsyncIterator[EmbeddedStack]:
    """Start the sims, their agents and the gateway; stop everything on exit.

    ``adapters``: demo LoRA adapters in the catalog (0: the adapter registry is off);
    ``max_loras``: the sims' ``--max-loras`` (default: the sim profile's);
    ``usd_per_hour``: price of a replica-hour for the cost metric (default: the sim profile's).
    """
    from replica.agent.agent import ReplicaAgent
    from replica.agent.config import AgentConfig
    from replica.fleet_store import MemoryFleetStore
    from replica.sim.fleet import start_sim_fleet
    from routing.index import MemoryBlockIndex

    index = MemoryBlockIndex()
    fleet_store = MemoryFleetStore()
    async with (
        start_sim_fleet(
            replicas,
            host="127.0.0.1",
            model=model,
            speed=sim_speed,
            profile=sim_profile,
            max_loras=max_loras,
        ) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        agent_urls = []
        for handle in fleet.replicas:
            agent = ReplicaAgent(
                AgentConfig(
                    replica_id=f"sim/{handle.index}",
                    engine_url=handle.url,
                    model=model,
                    kv_events_endpoint=handle.kv_events_endpoint,
                    replay_endpoint=handle.kv_replay_endpoint,
                    # Its own /metrics on a free port, as in production (agent lag and gaps).
                    listen_host="127.0.0.1",
                    listen_port=0,
                ),
                index=index,
                fleet=fleet_store,
            )
            await stack.enter_async_context(agent)
            agent_urls.append(f"http://127.0.0.1:{agent.listen_port}")
        await _wait_registered(fleet_store, replicas)
        config = GatewayConfig(default_profile=profile, admin_key=admin_key, health_interval_s=0.5)
        setup = None
        engine = fleet.replicas[0].replica.engine_config
        if adapters > 0:
            setup = demo_adapter_setup(
                model, fleet.urls, adapters, engine.max_loras, engine.max_cpu_loras
            )
        policy = dataclasses.replace(
            GatewayPolicy.default(profile=profile, usd_per_hour=_price(fleet, usd_per_hour)),
            # What an operator would write in the policy's pools for these engines, and what
            # the simulator starts routing from: the default 30 ms decode step is a 70B's, and
            # made the short-decode charge fire at twice the simulator's rate on an 8B.
            pool_speeds={
                "default": PoolSpeeds(
                    prefill_tokens_per_s=engine.configured_prefill_tokens_per_s,
                    decode_step_ms=engine.configured_decode_step_ms,
                )
            },
        )
        app = create_app(
            config,
            policy,
            index=index,
            tokenizer=SimPromptTokenizer(),
            fleet_store=fleet_store,
            adapters=setup,
        )
        runner, url = await start_site(
            app, host, port, config.drain_timeout_s, idle_timeout_s=config.idle_timeout_s
        )
        names = [a.name for a in setup.policy.adapters] if setup is not None else []
        try:
            yield EmbeddedStack(url, model, fleet.urls, app, names, agent_urls)
        finally:
            await runner.cleanup()


def _price(fleet: Any, usd_per_hour: float | None) -> float:
    """``usd_per_hour``, else what the sim profile says a replica costs (GPU price x TP)."""
    if usd_per_hour is not None:
        return usd_per_hour
    return float(fleet.replicas[0].replica.engine_config.replica_price_per_hour)


async def _wait_registered(fleet_store: FleetStore, count: int, timeout_s: float = 15.0) -> None:
    """Wait until every agent has registered its replica (their first scrape)."""
    async with asyncio.timeout(timeout_s):
        while len(await fleet_store.list_replicas()) < count:
            await asyncio.sleep(0.05)
