"""Everything one gateway process holds, in one object stored under a typed ``web.AppKey``."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from opentelemetry.trace import Tracer

from gateway.apis.background_responses import BackgroundResponses
from gateway.config import GatewayConfig
from gateway.cost import ReplicaTimeMeter, RouteWindow
from gateway.flow_control import FlowGate
from gateway.inflight import InflightTracker
from gateway.layout import LayoutDiagnostics
from gateway.metrics import GatewayMetrics
from gateway.policy_view import GatewayPolicy
from gateway.ratelimit import RateLimiter
from gateway.replicas import ReplicaRegistry
from gateway.request.record import DecisionRecord
from gateway.response_affinity import MemoryResponseAffinity, ResponseAffinity
from gateway.routing_glue import Router
from gateway.speculative import SpeculativeTarget, SpeculativeWriter, in_process_record
from gateway.upstream_client import UpstreamPool
from routing.contracts import BlockIndex, PromptTokenizer
from routing.types import ReplicaId

if TYPE_CHECKING:
    from adapters_registry import AdapterRegistry


@dataclass
class GatewayState:
    """The gateway's collaborators; handlers read them, background tasks keep them fresh."""

    config: GatewayConfig
    policy: GatewayPolicy
    registry: ReplicaRegistry
    index: BlockIndex
    index_backend: str
    engine: Router
    tokenizer: PromptTokenizer
    metrics: GatewayMetrics
    inflight: InflightTracker
    tracer: Tracer
    rate_limiter: RateLimiter = field(default_factory=RateLimiter)
    layout: LayoutDiagnostics = field(default_factory=LayoutDiagnostics)
    meter: ReplicaTimeMeter = field(default_factory=ReplicaTimeMeter)
    window: RouteWindow = field(default_factory=RouteWindow)
    #: The decision log (``/admin/decisions``): one record per finished request, newest last.
    decisions: deque[DecisionRecord] = field(default_factory=lambda: deque(maxlen=200))
    #: Pooled connections for health polls and adapter calls; opened in the cleanup context.
    session: aiohttp.ClientSession | None = None
    #: Keep-alive connections for the proxied requests themselves (``gateway/upstream_client``).
    upstream: UpstreamPool | None = None
    #: Set while shutting down: new requests get 503, in-flight ones drain.
    draining: bool = False
    #: Set on SIGTERM, ``stop_delay_s`` before the listener closes: ``/ready`` answers 503 so
    #: load balancers stop sending, while requests that still arrive are served.
    stopping: bool = False
    active_requests: int = 0
    #: The request ids in flight: routing and flow control key their state by request id, so
    #: a client's ``X-Request-Id`` already in use gets a suffix (``request_body.unique_id``).
    request_ids: set[str] = field(default_factory=set)
    #: (caller, client's id) of the requests in flight that sent their own ``X-Request-Id``:
    #: a suffix is shown only to a caller that reused its own id (``request_body.show_request_id``).
    asked_ids: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Retries on fallbacks before the first byte (the policy's ``gateway.max_retries``).
    max_retries: int = 2
    policy_errors: list[str] = field(default_factory=list)
    #: The policy file last loaded or refused: (mtime, inode), ``reload.file_identity``.
    policy_file_seen: tuple[float, int] | None = None
    #: What the last reload could not apply without a restart (``GatewayConfig.needs_restart``):
    #: the file's index settings differ from the running ones.
    restart_needed: list[str] = field(default_factory=list)
    #: The changed policy file's (mtime_ns, size, inode) at the last poll, read once it holds still.
    policy_settling: tuple[int, int, int] | None = None
    #: The policy file could not be read at the last poll (said once: ``reload.py``).
    policy_file_missing: bool = False
    #: The per-request speculative index write (``gateway/speculative.py``).
    speculative: SpeculativeWriter = field(default_factory=SpeculativeWriter)
    #: Short-lived tasks (index refreshes); awaited or cancelled on shutdown, never leaked.
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    #: Optional extra replica source (agents' fleet store), polled with the health loop.
    fleet_store: Any = None
    #: The LoRA adapter registry (see ``gateway/adapters.py``); None when adapters are off.
    #: Built in the app's cleanup context, once the upstream session exists.
    adapters: AdapterRegistry | None = None
    #: Which replica stored each ``/v1/responses`` answer (``previous_response_id`` goes back
    #: there): in memory, or in Redis when the gateway runs with Redis.
    response_affinity: ResponseAffinity = field(default_factory=MemoryResponseAffinity)
    #: Flow control (``gateway/flow_control.py``): set by ``create_app``; None in bare states.
    flow: FlowGate | None = None

    @functools.cached_property
    def speculative_target(self) -> SpeculativeTarget:
        """What the speculative writes need (index, replicas, TTL): fixed for the app's life."""
        return SpeculativeTarget(
            index=self.index,
            replicas=self.registry,
            ttl_s=self.config.speculative_ttl_s,
            count_error=self.metrics.index_errors.labels(self.index_backend).inc,
            count_slow=self.metrics.speculative_slow.labels(self.index_backend).inc,
            background=self.background,
            in_process=in_process_record(self.index),
        )

    @functools.cached_property
    def background_responses(self) -> BackgroundResponses:
        """Background Responses this gateway forwarded, accounted when they end."""

        def replica_url(replica: ReplicaId) -> str | None:
            state = self.registry.get(replica)
            return state.url if state is not None else None

        return BackgroundResponses(replica_url, self.http, self.background)

    def http(self) -> aiohttp.ClientSession:
        """The pooled upstream session (only valid while the app runs)."""
        if self.session is None:
            raise RuntimeError("gateway session is not open (app not started)")
        return self.session

    def upstream_pool(self) -> UpstreamPool:
        """The connections proxied requests go out on (only valid while the app runs)."""
        if self.upstream is None:
            raise RuntimeError("gateway upstream pool is not open (app not started)")
        return self.upstream


GATEWAY = web.AppKey("fleetgate_gateway", GatewayState)
