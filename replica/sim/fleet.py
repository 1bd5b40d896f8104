"""Several simulated replicas in one process, each on its own HTTP port and KV-event endpoint.

``start_sim_fleet`` is what ``fleetgate sim``, ``fleetgate up`` and the tests use::

    async with start_sim_fleet(2, speed=100) as fleet:
        fleet.urls                 # ["http://127.0.0.1:41001", "http://127.0.0.1:41002"]
        fleet.kv_event_endpoints   # subscriber side: ["tcp://127.0.0.1:39001", ...]
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from replica.kv_events import offset_port, subscriber_endpoint_for
from replica.kv_events.endpoints import tcp_host
from replica.sim.app import build_app
from replica.sim.server import REPLICA_KEY, SimReplica, SimServerConfig
from routing.hosts import is_ipv6, url_host
from routing.tokenize.word_hash import load_tokenizer


@dataclass
class SimReplicaHandle:
    """One running replica of a fleet."""

    index: int
    url: str
    #: Where a subscriber should point: connect to it, or bind it if the replica connects.
    kv_events_endpoint: str | None
    kv_replay_endpoint: str | None
    app: web.Application
    runner: web.AppRunner

    @property
    def replica(self) -> SimReplica:
        """The live engine, driver and metrics (for tests and benchmarks)."""
        return self.app[REPLICA_KEY]


@dataclass
class SimFleet:
    """Running replicas, in port order."""

    replicas: list[SimReplicaHandle] = field(default_factory=list)
    model: str = "sim-model"

    @property
    def urls(self) -> list[str]:
        """Base URLs (``http://host:port``); the OpenAI API is under ``/v1``."""
        return [r.url for r in self.replicas]

    @property
    def kv_event_endpoints(self) -> list[str | None]:
        """Per replica, the KV-event endpoint a subscriber uses (None with events off)."""
        return [r.kv_events_endpoint for r in self.replicas]

    @property
    def kv_replay_endpoints(self) -> list[str | None]:
        """Per replica, the ROUTER replay endpoint (None without replay)."""
        return [r.kv_replay_endpoint for r in self.replicas]


def _reachable(endpoint: str, host: str) -> str:
    """A bound wildcard address as a subscriber on ``host`` can connect to it: an IPv4
    wildcard (``*``, ``0.0.0.0``) listens on IPv4 only, so an IPv6 ``host`` reaches it at
    127.0.0.1 (the fleet runs on this machine); the IPv6 one (``[::]``) takes either."""
    bound = tcp_host(endpoint)
    if bound not in ("*", "0.0.0.0", "::"):
        return endpoint
    if bound != "::" and is_ipv6(host):
        host = "127.0.0.1"
    port = endpoint.rpartition(":")[2]
    return f"tcp://{url_host(host)}:{port}"


def _per_replica(endpoint: str | None, index: int) -> str | None:
    """Replica ``index``'s endpoint: a concrete port moves up by ``index``; ``*``/``0`` stay."""
    if endpoint is None or endpoint.endswith((":*", ":0")):
        return endpoint
    return offset_port(endpoint, index)


@contextlib.asynccontextmanager
async def start_sim_fleet(
    n: int,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    model: str = "sim-model",
    profile: str = "h100-llama3-8b",
    kv_events: str | None = "tcp://127.0.0.1:*",
    kv_replay: str | None = "tcp://127.0.0.1:*",
    kv_topic: str = "kv",
    speed: float = 1.0,
    seed: int = 0,
    max_loras: int | None = None,
    block_size: int | None = None,
    tokenizer_dir: str | None = None,
    engine_overrides: Mapping[str, Any] | None = None,
    max_waiting: int = 1024,
    default_max_tokens: int | None = 256,
) -> AsyncIterator[SimFleet]:
    """Start ``n`` replicas on ports ``port, port+1, …`` (``port=0``: any free ports).

    ``kv_events``/``kv_replay`` follow vLLM's rule (``*`` binds); a concrete port moves up by
    one per replica (``tcp://*:5557`` -> 5557, 5558, …) and ``*`` as the port picks free ones.
    Replica ``i`` is seeded ``seed + i``. Everything stops when the block exits.
    """
    if n < 1:
        raise ValueError(f"n: must be >= 1 (got {n})")
    overrides: dict[str, Any] = dict(engine_overrides or {})
    if max_loras is not None:
        overrides["max_loras"] = max_loras
        overrides.setdefault("max_cpu_loras", max(max_loras, 1) * 2)
    if block_size is not None:
        overrides["block_size"] = block_size
    tokenizer = load_tokenizer(tokenizer_dir)  # loaded once, shared by every replica
    fleet = SimFleet(model=model)
    try:
        for i in range(n):
            events = _per_replica(kv_events, i)
            replay = _per_replica(kv_replay, i)
            config = SimServerConfig(
                model=model, profile=profile, engine_overrides=overrides, seed=seed + i,
                speed=speed, kv_events_endpoint=events,
                kv_replay_endpoint=replay if events else None, kv_topic=kv_topic,
                tokenizer_dir=tokenizer_dir, max_waiting=max_waiting,
                default_max_tokens=default_max_tokens,
            )
            app = build_app(config, tokenizer)
            # handler_cancellation: like vLLM, a request whose client closed the connection is
            # aborted (its handler cancelled, the engine request dropped), streamed or not.
            runner = web.AppRunner(
                app, access_log=None, handle_signals=False, handler_cancellation=True
            )
            await runner.setup()
            try:
                site = web.TCPSite(runner, host, port + i if port else 0)
                await site.start()
            except BaseException:
                await runner.cleanup()
                raise
            bound_port = runner.addresses[0][1]
            replica = app[REPLICA_KEY]
            sub_endpoint = replay_endpoint = None
            if replica.publisher is not None:
                if "*" in (events or "") or "::" in (events or ""):
                    sub_endpoint = _reachable(replica.publisher.endpoint, host)
                else:
                    sub_endpoint = subscriber_endpoint_for(replica.publisher.endpoint)
                if replica.publisher.replay_endpoint is not None:
                    replay_endpoint = _reachable(replica.publisher.replay_endpoint, host)
            fleet.replicas.append(SimReplicaHandle(
                index=i, url=f"http://{url_host(host)}:{bound_port}",
                kv_events_endpoint=sub_endpoint, kv_replay_endpoint=replay_endpoint, app=app,
                runner=runner,
            ))
        yield fleet
    finally:
        for handle in reversed(fleet.replicas):
            await handle.runner.cleanup()
