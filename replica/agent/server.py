"""The agent's own HTTP endpoints: ``/metrics`` (Prometheus) and ``/health`` (JSON)."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from replica.agent.ingest import EventApplier
from replica.agent.metrics import AgentMetrics
from routing.types import ReplicaId


class ServedAgent(Protocol):
    """What these endpoints read from the agent; ``ReplicaAgent`` is the one implementation.

    A protocol rather than an import of ``ReplicaAgent``: the agent starts this server, so the
    server naming the agent back would make the two files an import cycle.
    """

    @property
    def replica(self) -> ReplicaId: ...

    @property
    def applier(self) -> EventApplier: ...

    @property
    def metrics(self) -> AgentMetrics: ...

    @property
    def engine_up(self) -> bool: ...

    @property
    def leaving(self) -> bool: ...

    @property
    def batches_applied(self) -> int: ...


AGENT_KEY: web.AppKey[ServedAgent] = web.AppKey("agent")


async def _metrics(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    body = generate_latest(agent.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _health(request: web.Request) -> web.Response:
    """200 while the agent runs (it is the agent's liveness); the body says how the engine is."""
    agent = request.app[AGENT_KEY]
    return web.json_response(
        {
            "replica": agent.replica,
            "epoch": agent.applier.epoch,
            "engine_up": agent.engine_up,
            # Stopping on purpose: gateways send it nothing new, what it holds finishes.
            "draining": agent.leaving,
            "index_dirty": agent.applier.dirty,
            "batches_applied": agent.batches_applied,
            "model": agent.applier.model,
        }
    )


def build_app(agent: ServedAgent) -> web.Application:
    """The aiohttp application serving one agent's endpoints."""
    app = web.Application()
    app[AGENT_KEY] = agent
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    return app


async def start_server(agent: ServedAgent, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``agent`` on ``host:port`` (0: a free port); return the runner and the bound port."""
    runner = web.AppRunner(build_app(agent), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # aiohttp exposes the bound sockets only here
    sockets = getattr(server, "sockets", None) or []
    bound = int(sockets[0].getsockname()[1]) if sockets else port
    return runner, bound
