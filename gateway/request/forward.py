"""Phase 2 of a request: forward it. A frozen ``ForwardPlan`` in, an ``UpstreamOutcome`` out.

(Both types live in ``gateway/proxy.py``, next to the code that reads the one and fills the other.)

``plan_forward`` turns the ``RouteDecision`` into the plan: the bytes to send (the client's, with
the gateway-owned fields set), the candidates in order (the choice, then its fallbacks), the retry
budget. ``forward`` starts the speculative index write for the chosen replica and hands the plan to
``gateway/proxy.py``, which tries the candidates and relays the answer. Every attempt reports to
the request's ``AttemptRecorder``: in-flight counts, replica time, the adapter held, the engine's
calibration, retries. When ``forward`` returns or raises, ``recorder.outcome`` is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
from aiohttp import web
from opentelemetry.trace import Tracer

from gateway import adapters, proxy, speculative
from gateway.cost import ReplicaTimeMeter
from gateway.errors import GatewayError, bad_request
from gateway.flow_control import EnginePriority
from gateway.inflight import InflightTracker
from gateway.metrics import GatewayMetrics
from gateway.policy_view import Tenant
from gateway.proxy import ForwardPlan, UpstreamOutcome
from gateway.replicas import ReplicaRegistry
from gateway.request.kinds import Body, RequestKind
from gateway.request.record import AdapterLoad
from gateway.request.route import RouteDecision
from gateway.routing_glue import Router
from gateway.speculative import SpeculativeTarget, SpeculativeWriter
from gateway.tracing import stage_span
from gateway.upstream_client import UpstreamPool
from routing.state import ReplicaState
from routing.types import ReplicaId

if TYPE_CHECKING:
    from adapters_registry import AdapterRegistry

_request_keys = itertools.count()


@runtime_checkable
class ForwardDeps(Protocol):
    """What ``forward`` reads from the gateway (``GatewayState`` is one)."""

    @property
    def registry(self) -> ReplicaRegistry: ...
    @property
    def tracer(self) -> Tracer: ...
    @property
    def speculative(self) -> SpeculativeWriter: ...
    @property
    def speculative_target(self) -> SpeculativeTarget: ...
    def upstream_pool(self) -> UpstreamPool: ...


@runtime_checkable
class AttemptDeps(Protocol):
    """What an ``AttemptRecorder`` updates per attempt (``GatewayState`` is one)."""

    @property
    def adapters(self) -> AdapterRegistry | None: ...
    @property
    def registry(self) -> ReplicaRegistry: ...
    @property
    def inflight(self) -> InflightTracker: ...
    @property
    def meter(self) -> ReplicaTimeMeter: ...
    @property
    def engine(self) -> Router: ...
    @property
    def metrics(self) -> GatewayMetrics: ...


def plan_forward(
    routed: RouteDecision,
    kind: RequestKind,
    body: Mapping[str, Any],
    raw: bytes,
    *,
    max_retries: int,
    read_timeout_s: float,
    priority: EnginePriority,
    client_stall_s: float | None = None,
) -> ForwardPlan:
    """The plan for ``routed``: ``raw`` reused as the payload where nothing must change.

    ``priority``: what vLLM's request ``priority`` field carries. Where the gateway sets it
    (``engine_priority`` on: engines under priority scheduling) it goes on chat and completion
    bodies (``kind.payload`` None), a client's own replaced there and dropped on every other
    API. Otherwise a client's own passes only where its tenant may choose its priority: an
    engine under priority scheduling would let anyone else jump its queue (and have others
    preempted) past the class its tenant was given.
    """
    if priority.value is not None or (not priority.client_may_set and "priority" in body):
        owned = {k: v for k, v in body.items() if k != "priority"}
        if priority.value is not None and kind.payload is None:
            owned["priority"] = priority.value
        if owned != body:
            body = owned
            raw = _encode(body)
    payload, hide_usage = (kind.payload or upstream_payload)(body, raw, routed.tenant)
    decision = routed.decision
    return ForwardPlan(
        request_id=routed.routing_request.request_id,
        route=routed.route.name,
        upstream_path=kind.upstream_path,
        payload=payload,
        stream=kind.streams and bool(body.get("stream")),
        hide_usage_chunk=hide_usage,
        candidates=(decision.replica, *decision.fallbacks),
        max_attempts=1 + max_retries,
        read_timeout_s=read_timeout_s,
        client_stall_s=client_stall_s,
        first_token_marker=kind.first_token_marker,
        stream_error=kind.stream_error,
        stream_end=kind.stream_end,
        error_response=kind.error_response,
    )


async def forward(
    gw: ForwardDeps,
    request: web.Request,
    routed: RouteDecision,
    plan: ForwardPlan,
    recorder: AttemptRecorder,
) -> web.StreamResponse:
    """Send ``plan``, relay the answer; ``recorder.outcome`` says what happened, even on error."""
    outcome = recorder.outcome
    routing_request = routed.routing_request
    chosen = routed.decision.replica
    depth = (routing_request.prefix_matches or {}).get(chosen, 0)
    insert = gw.speculative.start(gw.speculative_target, chosen, routing_request.chain, depth)
    with stage_span(gw.tracer, "fleetgate.upstream") as span:
        try:
            response = await proxy.send(request, plan, recorder, gw.upstream_pool(), gw.registry)
        except GatewayError as err:
            outcome.status = err.status
            outcome.error_code = err.code  # the handler counts it in fleetgate_errors_total
            raise
        except asyncio.CancelledError:
            outcome.client_gone = True  # aiohttp cancels the handler when the client leaves
            raise
        finally:
            span.set_attribute("fleetgate.status", outcome.status)
    await speculative.done(insert)
    return response


#: ``AttemptRecorder.prepare`` for a request without an adapter (reusable: it holds no state).
_NOTHING_TO_HOLD = contextlib.nullcontext()


class AttemptRecorder:
    """One request's per-attempt bookkeeping, the proxy's ``AttemptHooks``.

    In-flight counts and not-yet-prefilled tokens per replica, replica time per pool, the
    engine's start/complete calibration, queue time, retries, and the adapter held per attempt.
    """

    def __init__(self, gw: AttemptDeps, routed: RouteDecision, arrived: float) -> None:
        self.gw = gw
        self.routed = routed
        self.uncached = routed.uncached_tokens
        self.arrived = arrived
        self.key = next(_request_keys)
        self.outcome = UpstreamOutcome()
        self._unprefilled: dict[ReplicaId, int] = {}
        #: Wall-clock time each attempt was sent, for the tracker's ``ended_since``.
        self._sent_at: dict[ReplicaId, float] = {}
        self.attempts = 0
        #: Told which replica answers, before its answer reaches the client (the Responses API
        #: remembers where a response is stored: a fallback's answer is stored there).
        self.on_answer: Callable[[ReplicaId], Awaitable[None]] | None = None
        #: Told when the first attempt is on the books as in flight (flow control's pump waits
        #: for it before judging the next queued request).
        self.on_started: Callable[[], None] | None = None

    async def answering(self, replica: ReplicaId) -> None:
        """A replica answered 200: tell ``on_answer`` before anything is relayed."""
        if self.on_answer is not None:
            await self.on_answer(replica)

    def prepare(
        self, replica: ReplicaState, last_resort: bool
    ) -> contextlib.AbstractAsyncContextManager[object]:
        """Hold the request's adapter loaded on ``replica`` for this attempt (if it has one)."""
        if self.routed.adapter is None or self.gw.adapters is None:
            return _NOTHING_TO_HOLD
        return self._hold_adapter(replica, last_resort)

    @contextlib.asynccontextmanager
    async def _hold_adapter(self, replica: ReplicaState, last_resort: bool) -> AsyncIterator[None]:
        adapter = self.routed.adapter
        assert adapter is not None
        registry = self.gw.adapters
        assert registry is not None  # prepare() checked
        async with adapters.hold_adapter(
            registry, self.gw.registry, replica, adapter, last_resort
        ) as load:
            self.outcome.adapter_load = AdapterLoad(
                replica.replica_id, load.cold_ms, load.loaded_now
            )
            yield

    async def model_missing(self, replica: ReplicaId) -> bool:
        """An upstream 404 for the request's adapter: the engine lost it; load it again."""
        adapter = self.routed.adapter
        if adapter is None or self.gw.adapters is None:
            return False
        await self.gw.adapters.report_missing(replica, adapter)
        return True

    def retrying(self, reason: str) -> None:
        """The next candidate is tried because of ``reason`` (a low-cardinality label)."""
        self.gw.metrics.upstream_retries.labels(self.routed.route.name, reason).inc()

    def started(self, replica: ReplicaId) -> None:
        gw = self.gw
        self.attempts += 1
        if self.attempts == 1:  # queue time ends when the request first leaves the gateway
            gw.metrics.queue_time.labels(self.routed.route.name).observe(
                time.monotonic() - self.arrived
            )
        gw.inflight.start(replica, self.uncached)
        self._unprefilled[replica] = self.uncached
        self._sent_at[replica] = time.time()
        gw.meter.start(replica, self.key)
        gw.engine.observe_start(self.routed.routing_request, replica)
        if self.on_started is not None:
            self.on_started()

    def first_byte(self, replica: ReplicaId) -> None:
        tokens = self._unprefilled.pop(replica, 0)
        self.gw.inflight.prefilled(replica, tokens)

    def ended(self, replica: ReplicaId) -> None:
        gw = self.gw
        awaiting = replica in self._unprefilled  # no first byte came: it never prefilled
        gw.inflight.finish(
            replica,
            self._unprefilled.pop(replica, 0),
            self._sent_at.pop(replica, None),
            awaiting_prefill=awaiting,
        )
        state = gw.registry.get(replica)
        pool = state.pool if state else "unknown"
        charged = gw.meter.finish(replica, self.key)
        spent = self.outcome.replica_seconds
        spent[pool] = spent.get(pool, 0.0) + charged


# --------------------------------------------------------------------------- the payload


def with_client_salt(tenant: Tenant, body: Body, open_access: bool) -> Tenant:
    """The tenant a request is served as, with the client's own ``cache_salt`` where the
    gateway sets none: in open access (no tenants declared) a client may isolate its users
    with vLLM's salt, as it could without the gateway. Routing hashes with it too, so a salted
    prompt never looks cached where only the unsalted one is. Declared tenants always get
    their own salt, whatever the client sends."""
    salt = body.get("cache_salt")
    if not open_access or tenant.cache_salt or salt is None:  # null: no salt, as for vLLM
        return tenant
    if not isinstance(salt, str) or not salt:  # as vLLM itself refuses it
        raise bad_request("`cache_salt` must be a non-empty string if given.", "cache_salt")
    return replace(tenant, cache_salt=salt)


#: Fields a client never sets on the engine: ``kv_transfer_params`` steers an engine's KV
#: connector (disaggregated prefill: where to pull blocks from, or push them to), which is
#: the deployment's to set, not a tenant's. Dropped from every body the gateway relays.
ENGINE_ONLY_FIELDS: frozenset[str] = frozenset({"kv_transfer_params"})


def without_engine_only_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` less ``ENGINE_ONLY_FIELDS``."""
    return {k: v for k, v in body.items() if k not in ENGINE_ONLY_FIELDS}


def upstream_body(body: Mapping[str, Any], tenant: Tenant) -> tuple[dict[str, Any], bool]:
    """The body vLLM gets: the client's, with the gateway-owned fields set.

    Returns the body and whether the stream's usage chunk must be hidden from the client (the
    gateway asks for it to learn ``cached_tokens``; a client that did not ask must not see it).
    """
    out = without_engine_only_fields(body)
    if tenant.cache_salt:
        out["cache_salt"] = tenant.cache_salt
    else:
        out.pop("cache_salt", None)  # the gateway owns the salt: never trust the client's
    hide_usage = False
    if out.get("stream"):
        options = dict(out.get("stream_options") or {})
        if not options.get("include_usage"):
            options["include_usage"] = True
            # vLLM sends per-chunk usage only with include_usage: the client who asked for it
            # without include_usage gets none, and must not get it because the gateway asked.
            options.pop("continuous_usage_stats", None)
            hide_usage = True
        out["stream_options"] = options
    return out, hide_usage


_msgspec_encode = msgspec.json.encode


def _encode(value: Any) -> bytes:
    """JSON bytes, fast (msgspec); the standard library for what msgspec refuses."""
    try:
        return _msgspec_encode(value)
    except (TypeError, ValueError, OverflowError):
        return json.dumps(value).encode()


def upstream_payload(body: Mapping[str, Any], raw: bytes, tenant: Tenant) -> tuple[bytes, bool]:
    """``upstream_body`` as bytes, reusing the client's ``raw`` bytes where possible.

    Nothing to change: ``raw`` itself. Fields to add that the client did not send: spliced in
    before the closing brace. Anything else (a client ``cache_salt`` to replace or drop,
    ``stream_options`` to amend): the changed body, re-encoded.
    """
    salt = tenant.cache_salt or None
    streaming = bool(body.get("stream"))
    options = body.get("stream_options") if streaming else None
    has_usage = bool(options and options.get("include_usage"))
    hide_usage = streaming and not has_usage
    head = raw.rstrip()
    if (
        "cache_salt" not in body
        and ENGINE_ONLY_FIELDS.isdisjoint(body)
        and (options is None or has_usage)
        and body
        and head.startswith(b"{")
        and head.endswith(b"}")
    ):
        extra = b""
        if salt is not None:
            extra += b',"cache_salt":' + _encode(salt)
        if hide_usage:
            extra += b',"stream_options":{"include_usage":true}'
        return (head[:-1] + extra + b"}" if extra else raw), hide_usage
    out, hide_usage = upstream_body(body, tenant)
    return _encode(out), hide_usage
