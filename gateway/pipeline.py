"""One completion request end to end: authenticate, route, proxy, account.

The steps, in order: tenant from the API key → rate limit → model and adapter the tenant may use →
route → tokenize and hash the prompt → the route's profile picks a replica (with the adapter
registry's cold-load estimate per replica) → speculative index entry → proxy (the adapter loaded
and held on the replica first; retrying fallbacks before the first byte) → metrics, index
feedback, calibration.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from gateway import adapters, errors, proxy, speculative
from gateway.auth import authenticate
from gateway.errors import GatewayError, model_not_found
from gateway.policy_view import Route, Tenant
from gateway.proxy import UpstreamOutcome
from gateway.request_body import read_body, request_id_of, validate
from gateway.state import GATEWAY, GatewayState
from gateway.tracing import NullTracer, record_stage_spans
from routing.contracts import NoReplicaAvailable, RoutingDecision, RoutingRequest, TokenizedPrompt
from routing.hashing import CHARS_PER_TOKEN, chain_seed, prompt_chain
from routing.state import ReplicaState
from routing.types import ReplicaId

log = logging.getLogger(__name__)

#: Route label for errors raised before a route was matched.
UNROUTED = "unrouted"
_request_keys = itertools.count()


@dataclass
class Routed:
    """A request after routing: everything accounting needs afterwards."""

    route: Route
    tenant: Tenant
    base_model: str
    adapter: str | None
    prompt: TokenizedPrompt
    block_size: int
    routing_request: RoutingRequest
    decision: RoutingDecision
    log_entry: dict[str, Any]


def resolve_model(gw: GatewayState, tenant: Tenant, model: str) -> tuple[str, str | None]:
    """(base model, adapter) for ``model``; 404 if unknown or another tenant's adapter."""
    if gw.adapters is not None:  # the catalog decides (runtime additions included)
        return adapters.resolve_model(gw, tenant, model)
    policy = gw.policy
    if policy.source is not None:
        resolved = policy.resolve_model(tenant, model)
        if resolved is None or resolved[0] not in policy.known_models:
            raise model_not_found(model)
        return resolved
    if model in gw.registry.base_models():
        return model, None
    parent = gw.registry.served_adapters.get(model)
    if parent is not None:
        return parent, model
    raise model_not_found(model)


async def tokenize(
    gw: GatewayState, kind: str, model: str, body: Mapping[str, Any]
) -> TokenizedPrompt:
    """What vLLM will tokenize, via the configured tokenizer (text mode by default)."""
    if kind == "chat":
        kwargs = body.get("chat_template_kwargs") or {}
        return await gw.tokenizer.tokenize_chat(model, body["messages"], **kwargs)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return await gw.tokenizer.tokenize_completion(model, prompt)
    if isinstance(prompt[0], str):  # a batch goes to one replica: route on its first prompt
        return await gw.tokenizer.tokenize_completion(model, prompt[0])
    if isinstance(prompt[0], int):
        return TokenizedPrompt(token_ids=list(prompt))
    return TokenizedPrompt(token_ids=list(prompt[0]))


async def _tokenize_or_degrade(
    gw: GatewayState, kind: str, model: str, body: Mapping[str, Any]
) -> TokenizedPrompt:
    """Tokenize; a malformed message is the client's 400, a tokenizer outage degrades to text."""
    from routing.tokenize import InvalidMessages, TextTokenizer

    try:
        return await tokenize(gw, kind, model, body)
    except (InvalidMessages, ValueError, TypeError) as exc:
        message = f"Invalid prompt: {exc}"
        raise GatewayError(400, errors.INVALID_REQUEST, message, "messages") from None
    except Exception as exc:  # remote tokenizer down: route on text blocks rather than fail
        log.warning("tokenizer failed (%s); routing on text blocks for this request", exc)
        text = TextTokenizer()
        if kind == "chat":
            return await text.tokenize_chat(model, body["messages"])
        prompt = body["prompt"]
        return await text.tokenize_completion(model, prompt if isinstance(prompt, str) else "")


def prompt_units(prompt: TokenizedPrompt) -> int:
    """The prompt's length in tokens: exact with token ids, estimated in text mode.

    A text block is ``block_size * CHARS_PER_TOKEN`` characters and stands for ``block_size``
    tokens (``routing.hashing.prompt_chain``), so the estimate is characters / CHARS_PER_TOKEN
    (rounded up): ``matched_blocks * block_size`` and this length are then in the same units.
    """
    if prompt.token_ids is not None:
        return len(prompt.token_ids)
    return -(-len(prompt.text or "") // CHARS_PER_TOKEN)


def block_size_for(gw: GatewayState, model: str) -> int:
    """Hashing granularity: the policy's, else a serving replica's, else the configured default."""
    if model in gw.policy.block_sizes:
        return gw.policy.block_sizes[model]
    for state in gw.registry.all():
        if state.serves(model):
            return state.block_size
    return gw.config.block_size


def admit(gw: GatewayState, request: web.Request) -> Tenant:
    """The caller's tenant, within its rate limit: checked before the body is even read."""
    tenant = authenticate(request, gw.policy)
    wait_s = gw.rate_limiter.acquire(tenant.name, tenant.rate_limit_rps, tenant.burst)
    if wait_s is not None:
        raise GatewayError(
            429,
            errors.RATE_LIMITED,
            "Rate limit exceeded for this API key.",
            headers={"Retry-After": str(max(1, round(wait_s)))},
        )
    return tenant


async def route_request(
    gw: GatewayState,
    request: web.Request,
    tenant: Tenant,
    kind: str,
    body: Mapping[str, Any],
    request_id: str,
    labels: dict[str, str],
) -> Routed:
    """Everything between admission and the upstream call; raises ``GatewayError``.

    Fills ``labels`` (route, base model) as soon as they are known, for error metrics.
    """
    model = str(body["model"])
    base_model, adapter = resolve_model(gw, tenant, model)
    labels["model"] = base_model
    if adapter is not None and gw.adapters is not None:
        gw.adapters.record_request(adapter)  # once per client request, not per attempt
    route = gw.policy.route_for(request.path, model, tenant.name, request.headers)
    if route is None:
        raise GatewayError(404, errors.NO_ROUTE, f"No route accepts model `{model}`.", "model")
    labels["route"] = route.name
    with gw.tracer.start_as_current_span("fleetgate.tokenize"):
        prompt = await _tokenize_or_degrade(gw, kind, base_model, body)
    block_size = block_size_for(gw, base_model)
    try:
        chain = prompt_chain(prompt, block_size, chain_seed(base_model, adapter, tenant.cache_salt))
    except ValueError as exc:  # e.g. token ids outside [0, 2**32)
        raise GatewayError(
            400, errors.INVALID_REQUEST, f"Invalid prompt: {exc}", "prompt"
        ) from None
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    prompt_tokens = prompt_units(prompt)
    routing_request = RoutingRequest(
        request_id=request_id,
        model=base_model,
        adapter=adapter,
        tenant=tenant.name,
        route=route.name,
        prompt_tokens=prompt_tokens,
        chain=chain,
        block_size=block_size,
        max_output_tokens=max_tokens if isinstance(max_tokens, int) else None,
    )
    gw.registry.set_inflight(gw.inflight.counts())
    replicas = gw.registry.routable()
    adapters.fill_cold_load_estimates(gw, routing_request, replicas)
    decide_start_ns = time.time_ns()
    last_resort = False
    with gw.tracer.start_as_current_span("fleetgate.route") as span:
        try:
            decision = await gw.engine.route(routing_request, replicas, route.profile)
        except NoReplicaAvailable as exc:
            decision = await _route_last_resort(gw, routing_request, route, exc)
            last_resort = True
        span.set_attribute("fleetgate.replica", decision.replica)
        span.set_attribute("fleetgate.degraded", decision.degraded)
        if not isinstance(gw.tracer, NullTracer):
            timings = decision.timings_ms
            plugin_ms = sum(
                ms
                for key, ms in timings.items()
                if key.startswith(("filter:", "scorer:", "picker:"))
            )
            stages = {"index": timings["index"]} if "index" in timings else {}
            stages["scoring"] = plugin_ms
            record_stage_spans(
                gw.tracer,
                decide_start_ns,
                stages,
                {"index": "fleetgate.index_lookup", "scoring": "fleetgate.scoring"},
            )
    _decision_metrics(gw, route.name, decision)
    entry = {
        "at": time.time(),
        "request_id": request_id,
        "route": route.name,
        "tenant": tenant.name,
        "model": base_model,
        "adapter": adapter,
        "prompt_tokens": prompt_tokens,
        "blocks": len(chain),
        "replica": decision.replica,
        "fallbacks": list(decision.fallbacks),
        "profile": decision.profile,
        "degraded": decision.degraded,
        "last_resort": last_resort,
        "timings_ms": dict(decision.timings_ms),
        # The engine's lazy explanation map, rendered only when /admin/decisions is read: copying
        # every replica's terms on every request cost more than the routing decision itself.
        "explanations": decision.explanations,
    }
    gw.decisions.append(entry)
    return Routed(
        route, tenant, base_model, adapter, prompt, block_size, routing_request, decision, entry
    )


async def _route_last_resort(
    gw: GatewayState, request: RoutingRequest, route: Route, cause: NoReplicaAvailable
) -> RoutingDecision:
    """No replica of the model is healthy: route among those that only missed health polls.

    503 only when none is left (none known, or every circuit open): degrade rather than fail.
    """
    replicas = gw.registry.last_resort(request.model)
    if not replicas:
        raise GatewayError(
            503, errors.NO_HEALTHY_REPLICA, str(cause), headers={"Retry-After": "1"}
        ) from None
    log.warning(
        "no healthy replica serves %s; last resort among %d that missed health polls",
        request.model,
        len(replicas),
    )
    gw.metrics.last_resort.labels(request.route).inc()
    adapters.fill_cold_load_estimates(gw, request, replicas)
    try:
        return await gw.engine.route(request, replicas, route.profile)
    except NoReplicaAvailable as exc:  # e.g. a filter of the profile left none of them
        raise GatewayError(
            503, errors.NO_HEALTHY_REPLICA, str(exc), headers={"Retry-After": "1"}
        ) from None


def _decision_metrics(gw: GatewayState, route: str, decision: RoutingDecision) -> None:
    m = gw.metrics
    total_ms = decision.timings_ms.get("total")
    if total_ms is not None:
        m.decision_seconds.labels(decision.profile).observe(total_ms / 1000)
    index_ms = decision.timings_ms.get("index")
    if index_ms is not None:
        m.index_lookup_seconds.labels(gw.index_backend).observe(index_ms / 1000)
    if decision.degraded:
        m.degraded.labels(route, "index_unavailable").inc()
        m.index_errors.labels(gw.index_backend).inc()


def upstream_body(body: Mapping[str, Any], tenant: Tenant) -> tuple[dict[str, Any], bool]:
    """The body vLLM gets: the client's, with the gateway-owned fields set.

    Returns the body and whether the stream's usage chunk must be hidden from the client (the
    gateway asks for it to learn ``cached_tokens``; a client that did not ask must not see it).
    """
    out = dict(body)
    if tenant.cache_salt:
        out["cache_salt"] = tenant.cache_salt
    else:
        out.pop("cache_salt", None)  # the gateway owns the salt: never trust the client's
    hide_usage = False
    if out.get("stream"):
        options = dict(out.get("stream_options") or {})
        if not options.get("include_usage"):
            options["include_usage"] = True
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


async def handle_completion(
    request: web.Request, kind: str, upstream_path: str
) -> web.StreamResponse:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``."""
    gw = request.app[GATEWAY]
    request_id = request_id_of(request)
    arrived = time.monotonic()
    # Metric labels, filled in as they become known (server-controlled values only).
    labels = {"route": UNROUTED, "model": ""}
    forwarded = False
    gw.active_requests += 1
    try:
        with gw.tracer.start_as_current_span("fleetgate.request") as span:
            span.set_attribute("fleetgate.kind", kind)
            if gw.draining:
                raise GatewayError(503, errors.SHUTTING_DOWN, "The gateway is shutting down.")
            tenant = admit(gw, request)
            body, raw = await read_body(request, gw.config.max_body_bytes)
            validate(body, kind)
            routed = await route_request(gw, request, tenant, kind, body, request_id, labels)
            span.set_attribute("fleetgate.route", routed.route.name)
            forwarded = True  # from here on, accounting records the request
            return await _forward(
                gw, request, routed, body, raw, upstream_path, request_id, arrived
            )
    except GatewayError as err:
        gw.metrics.errors.labels(labels["route"], err.code).inc()
        if not forwarded:
            status = str(err.status)
            gw.metrics.requests.labels(labels["route"], labels["model"], "none", status).inc()
        return err.response(request_id)
    finally:
        gw.active_requests -= 1


async def _forward(
    gw: GatewayState,
    request: web.Request,
    routed: Routed,
    body: Mapping[str, Any],
    raw: bytes,
    upstream_path: str,
    request_id: str,
    arrived: float,
) -> web.StreamResponse:
    decision = routed.decision
    matched = decision.explanations.get(decision.replica)
    matched_blocks = matched.matched_blocks if matched else 0
    # Tokens (estimated in text mode): the units of matched_blocks * block_size.
    uncached = max(0, routed.routing_request.prompt_tokens - matched_blocks * routed.block_size)
    outcome = UpstreamOutcome()
    payload, hide_usage = upstream_payload(body, raw, routed.tenant)
    stream = bool(body.get("stream"))

    hooks = _Attempts(gw, routed, uncached, arrived)
    candidates = [decision.replica, *decision.fallbacks]
    routing_request = routed.routing_request
    depth = (routing_request.prefix_matches or {}).get(decision.replica, 0)
    insert = gw.speculative.start(gw, decision.replica, routing_request.chain, depth)
    with gw.tracer.start_as_current_span("fleetgate.upstream") as span:
        try:
            response = await proxy.send(
                gw,
                request,
                upstream_path,
                payload,
                stream,
                candidates,
                request_id,
                routed.route.name,
                hide_usage,
                outcome,
                hooks,
            )
        except GatewayError as err:
            outcome.status = err.status
            raise
        except asyncio.CancelledError:
            outcome.client_gone = True  # aiohttp cancels the handler when the client leaves
            raise
        finally:
            span.set_attribute("fleetgate.status", outcome.status)
            # Bookkeeping runs once the answer is on its way: aiohttp writes the response when
            # this handler returns, before the loop runs the next callback, so metrics, the
            # decision log and the layout detector stay off the client's latency (they are
            # still done before this gateway reads the client's next request).
            asyncio.get_running_loop().call_soon(
                _after_response, gw, routed, outcome, arrived, hooks.replica_seconds, stream
            )
        await speculative.done(insert)
    return response


def _after_response(
    gw: GatewayState,
    routed: Routed,
    outcome: UpstreamOutcome,
    arrived: float,
    replica_seconds: dict[str, float],
    stream: bool,
) -> None:
    from gateway.accounting import account  # local: accounting imports this module's types

    account(gw, routed, outcome, arrived, replica_seconds, stream)
    try:
        chain = routed.routing_request.chain
        gw.layout.observe(routed.route.name, routed.prompt, chain, routed.block_size)
    except Exception:  # a detector must never disturb serving
        log.exception("prompt layout detector failed")


#: ``_Attempts.prepare`` for a request without an adapter (reusable: it holds no state).
_NOTHING_TO_HOLD = contextlib.nullcontext()


class _Attempts:
    """Per-attempt bookkeeping: in-flight counts, replica time, plugin hooks, queue time."""

    def __init__(self, gw: GatewayState, routed: Routed, uncached: int, arrived: float) -> None:
        self.gw = gw
        self.routed = routed
        self.uncached = uncached
        self.arrived = arrived
        self.key = next(_request_keys)
        #: pool -> replica seconds charged to this request (a retry may span two pools).
        self.replica_seconds: dict[str, float] = {}
        self._unprefilled: dict[ReplicaId, int] = {}
        self.attempts = 0

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
        async with adapters.hold_adapter(self.gw, replica, adapter, last_resort) as load:
            self.routed.log_entry["adapter_load"] = {
                "replica": replica.replica_id,
                "cold_ms": round(load.cold_ms, 3),
                "loaded_now": load.loaded_now,
            }
            yield

    async def model_missing(self, replica: ReplicaId) -> bool:
        """An upstream 404 for the request's adapter: the engine lost it; load it again."""
        adapter = self.routed.adapter
        if adapter is None or self.gw.adapters is None:
            return False
        await self.gw.adapters.report_missing(replica, adapter)
        return True

    def started(self, replica: ReplicaId) -> None:
        gw = self.gw
        self.attempts += 1
        if self.attempts == 1:  # queue time ends when the request first leaves the gateway
            gw.metrics.queue_time.labels(self.routed.route.name).observe(
                time.monotonic() - self.arrived
            )
        gw.inflight.start(replica, self.uncached)
        self._unprefilled[replica] = self.uncached
        gw.meter.start(replica, self.key)
        gw.engine.observe_start(self.routed.routing_request, replica)

    def first_byte(self, replica: ReplicaId) -> None:
        tokens = self._unprefilled.pop(replica, 0)
        self.gw.inflight.prefilled(replica, tokens)

    def ended(self, replica: ReplicaId) -> None:
        gw = self.gw
        gw.inflight.finish(replica, self._unprefilled.pop(replica, 0))
        state = gw.registry.get(replica)
        pool = state.pool if state else "unknown"
        charged = gw.meter.finish(replica, self.key)
        self.replica_seconds[pool] = self.replica_seconds.get(pool, 0.0) + charged
