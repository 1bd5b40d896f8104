"""Phase 1 of a request: admit it, then route it. Hands on a ``RouteDecision``.

In order: ``admit`` (tenant from the API key, its rate limit: before the body is read) → the
handler reads and checks the body → *admission* → ``route``: model and adapter the tenant may use →
the policy's route → the prompt, tokenized as vLLM will → its block chain → the route's profile
picks a replica (``routing/engine.py``; last resort among replicas that only missed health polls).

Extending it:

- A new endpoint (Responses, Anthropic Messages, embeddings, ...) is a new ``RequestKind`` in
  ``kinds.py`` (how to check its body, what prompt to route on, its upstream path, whether it is
  prefix-routed); ``route`` takes the kind and needs no change.
- Admission control (queueing, concurrency limits) goes in ``handler.handle``, at the line marked
  ``ADMISSION``: after authentication and body checks, before ``route``. Anything it raises as a
  ``GatewayError`` reaches the client in the OpenAI error envelope and is counted.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from aiohttp import web
from opentelemetry.trace import Tracer

from gateway import adapters, errors
from gateway.auth import authenticate
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, model_not_found
from gateway.inflight import InflightTracker
from gateway.metrics import GatewayMetrics
from gateway.policy_view import GatewayPolicy, Route, Tenant
from gateway.ratelimit import RateLimiter
from gateway.replicas import ReplicaRegistry
from gateway.request.kinds import Body, RequestKind
from gateway.routing_glue import Router
from gateway.tracing import NullTracer, record_stage_spans, stage_span
from routing.contracts import (
    NoReplicaAvailable,
    PromptTokenizer,
    RoutingDecision,
    RoutingRequest,
    TokenizedPrompt,
)
from routing.flow_control import BudgetReservation
from routing.hashing import CHARS_PER_TOKEN, chain_seed, prompt_chain
from routing.types import ReplicaId

if TYPE_CHECKING:
    from adapters_registry import AdapterRegistry

log = logging.getLogger(__name__)

#: Route label for errors raised before a route was matched.
UNROUTED = "unrouted"
#: The prompt of a kind that is not prefix-routed: no blocks to match.
_NO_PROMPT = TokenizedPrompt(token_ids=[])


@runtime_checkable
class RouteDeps(Protocol):
    """What the route phase reads from the gateway (``GatewayState`` is one).

    Read per request, not copied: a policy reload swaps ``policy``, and the adapter registry
    exists only once the app has started.
    """

    @property
    def policy(self) -> GatewayPolicy: ...
    @property
    def adapters(self) -> AdapterRegistry | None: ...
    @property
    def registry(self) -> ReplicaRegistry: ...
    @property
    def tokenizer(self) -> PromptTokenizer: ...
    @property
    def engine(self) -> Router: ...
    @property
    def inflight(self) -> InflightTracker: ...
    @property
    def tracer(self) -> Tracer: ...
    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def index_backend(self) -> str: ...
    @property
    def config(self) -> GatewayConfig: ...


class RequestLabels:
    """Metric labels of the request, filled in as they become known (server-controlled values)."""

    __slots__ = ("model", "route")

    def __init__(self) -> None:
        self.route = UNROUTED
        self.model = ""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """A routed request: what the forward and account phases need to know about it."""

    route: Route
    tenant: Tenant
    base_model: str
    adapter: str | None
    prompt: TokenizedPrompt
    block_size: int
    routing_request: RoutingRequest
    decision: RoutingDecision
    #: Routed among replicas that only missed health polls (none was healthy).
    last_resort: bool
    #: Wall-clock time of the decision, for the decision log.
    routed_at: float
    #: Monotonic time of the decision (a held request's is its release): the TTFT routing
    #: predicted runs from here, so calibration measures from here too, not from arrival.
    decided_at: float = dataclasses.field(default_factory=time.monotonic)
    #: The prompt tokens a token budget reserves for it up front: the routed prompt's, or the
    #: whole input's estimate where that is more (a completions batch, embeddings, pooling).
    budget_prompt_tokens: int = 0
    #: What flow control reserved of the tenant's prompt budget (None: nothing), settled
    #: against the engine's count when the request ends.
    budget_reserved: BudgetReservation | None = None

    @property
    def prompt_counted(self) -> bool:
        """Whether ``routing_request.prompt_tokens`` is a count of token ids (a tokenizer's, or
        the client's own ids), not text mode's estimate from characters."""
        return self.prompt.token_ids is not None

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens the chosen replica must prefill (estimated in text mode)."""
        matched = self.decision.explanations.get(self.decision.replica)
        matched_blocks = matched.matched_blocks if matched else 0
        return max(0, self.routing_request.prompt_tokens - matched_blocks * self.block_size)


def admit(request: web.Request, policy: GatewayPolicy, rate_limiter: RateLimiter) -> Tenant:
    """The caller's tenant, within its rate limit: checked before the body is even read."""
    tenant = authenticate(request, policy)
    wait_s = rate_limiter.acquire(tenant.name, tenant.rate_limit_rps, tenant.burst)
    if wait_s is not None:
        raise GatewayError(
            429,
            errors.RATE_LIMITED,
            "Rate limit exceeded for this API key.",
            headers={"Retry-After": str(max(1, round(wait_s)))},
        )
    return tenant


async def route(
    gw: RouteDeps,
    request: web.Request,
    tenant: Tenant,
    kind: RequestKind,
    body: Body,
    request_id: str,
    labels: RequestLabels,
    pinned: ReplicaId | None = None,
) -> RouteDecision:
    """Everything between admission and the upstream call; raises ``GatewayError``.

    Fills ``labels`` (route, base model) as soon as they are known, for error metrics.
    ``pinned``: the one replica that can serve the request (``RequestKind.pinned_replica``);
    the policy is not asked, and there is no fallback.
    """
    model = str(body["model"])
    policy = gw.policy  # one policy for the whole decision, even if a reload swaps it meanwhile
    base_model, adapter = resolve_model(policy, gw.registry, gw.adapters, tenant, model)
    labels.model = base_model
    if adapter is not None and gw.adapters is not None:
        gw.adapters.record_request(adapter)  # once per client request, not per attempt
    matched_route = policy.route_for(request.path, model, tenant.name, request.headers)
    if matched_route is None:
        raise GatewayError(404, errors.NO_ROUTE, f"No route accepts model `{model}`.", "model")
    labels.route = matched_route.name
    # A pinned request's engine prompt is a stored conversation plus this turn: the blocks of this
    # turn alone are not what the engine caches, so they are neither matched, written
    # speculatively, nor shown to the layout detector.
    if kind.prefix_routed and pinned is None:
        with stage_span(gw.tracer, "fleetgate.tokenize"):
            prompt = await _prompt_or_degrade(
                gw.tokenizer, kind, base_model, body, tenant.cache_salt or ""
            )
    else:
        prompt = _NO_PROMPT
    block_size = block_size_for(policy, gw.registry, base_model, gw.config.block_size)
    try:
        chain = prompt_chain(prompt, block_size, chain_seed(base_model, adapter, tenant.cache_salt))
    except ValueError as exc:  # e.g. token ids outside [0, 2**32)
        raise GatewayError(
            400, errors.INVALID_REQUEST, f"Invalid prompt: {exc}", "prompt"
        ) from None
    routing_request = RoutingRequest(
        request_id=request_id,
        model=base_model,
        adapter=adapter,
        tenant=tenant.name,
        route=matched_route.name,
        prompt_tokens=prompt_units(prompt),
        chain=chain,
        block_size=block_size,
        max_output_tokens=output_budget(body),
        choices=choices_of(body),
        **declared_slos(policy, tenant.name, matched_route),
    )
    if pinned is not None:
        decision, last_resort = pinned_decision(pinned), False
    else:
        decision, last_resort = await _pick_replica(gw, routing_request, matched_route)
    prompt_tokens = routing_request.prompt_tokens
    return RouteDecision(
        matched_route,
        tenant,
        base_model,
        adapter,
        prompt,
        block_size,
        routing_request,
        decision,
        last_resort,
        time.time(),
        budget_prompt_tokens=(
            kind.budget_prompt(body, prompt_tokens) if kind.budget_prompt else prompt_tokens
        ),
    )


def declared_slos(policy: GatewayPolicy, tenant: str, route: Route) -> dict[str, float | None]:
    """The request's TTFT and TPOT objectives as its tenant (flow control's ``ttft_slo_ms`` /
    ``tpot_slo_ms``) or else its route (``slo``) declares them; None where neither does. The
    defaults the metrics measure an undeclared route against are not objectives routing
    should bend to (a 100 ms TPOT default would halve fleet-cost's short-decode protection)."""
    spec = policy.source.tenant(tenant) if policy.source is not None else None
    ttft = spec.ttft_slo_ms if spec is not None else None
    tpot = spec.tpot_slo_ms if spec is not None else None
    if route.slo_declared:
        ttft = ttft if ttft is not None else route.ttft_slo_ms
        tpot = tpot if tpot is not None else route.tpot_slo_ms
    return {"ttft_slo_ms": ttft, "tpot_slo_ms": tpot}


def output_budget(body: Body) -> int | None:
    """The output budget the request states (``max_completion_tokens``, else ``max_tokens``, else
    Responses' ``max_output_tokens``); None when it states none."""
    value = (
        body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    )
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def choices_of(body: Body) -> int:
    """How many answers the request has decoded side by side: ``n`` (1 when it states none or
    none valid: the engine refuses those) for each prompt of a completions batch."""
    value = body.get("n")
    valid = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    prompt = body.get("prompt")
    batch = (
        len(prompt)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        else 1
    )
    return (value if valid else 1) * batch


async def repick(
    gw: RouteDeps, routed: RouteDecision, only: frozenset[ReplicaId] | None = None
) -> RouteDecision:
    """``routed`` routed again on the fleet as it is now (flow control's queued requests), or
    among ``only`` those replicas (a request flow control steers off a replica decoding too
    slowly for it; ``NoReplicaAvailable`` when none of them is routable)."""
    if routed.decision.profile == PINNED_PROFILE:
        return routed  # only its replica holds what it continues (a stored response)
    decision, last_resort = await _pick_replica(gw, routed.routing_request, routed.route, only)
    return dataclasses.replace(
        routed,
        decision=decision,
        last_resort=last_resort,
        routed_at=time.time(),
        decided_at=time.monotonic(),
    )


#: The ``profile`` a pinned request's decision shows in the decision log.
PINNED_PROFILE = "pinned"


def pinned_decision(replica: ReplicaId) -> RoutingDecision:
    """The decision for a request that only ``replica`` can serve: no scoring, no fallback."""
    return RoutingDecision(
        replica=replica, fallbacks=[], profile=PINNED_PROFILE, degraded=False, explanations={}
    )


def resolve_model(
    policy: GatewayPolicy,
    replicas: ReplicaRegistry,
    adapter_registry: AdapterRegistry | None,
    tenant: Tenant,
    model: str,
) -> tuple[str, str | None]:
    """(base model, adapter) for ``model``; 404 if unknown or another tenant's adapter."""
    if adapter_registry is not None:  # the catalog decides (runtime additions included)
        return adapters.resolve_model(adapter_registry, policy, replicas, tenant, model)
    if policy.source is not None:
        resolved = policy.resolve_model(tenant, model)
        if resolved is None or resolved[0] not in policy.known_models:
            raise model_not_found(model)
        return resolved
    if model in replicas.base_models():
        return model, None
    parent = replicas.served_adapters.get(model)
    if parent is not None:
        return parent, model
    if not replicas.all() and replicas.discovery_error is not None:
        # No replica known because the store agents register them in cannot be read: saying
        # "no such model" would send the caller after the wrong problem (TLS review).
        raise GatewayError(
            503,
            errors.NO_HEALTHY_REPLICA,
            # The reason stays in the gateway's log: a client is not told the fleet's insides.
            "No replica is known yet: this gateway discovers replicas in its fleet store (Redis), "
            "which it cannot read now (the gateway's log says why: check Redis and the URL's "
            "host, password and TLS options in --redis or discovery.redis_url).",
            "model",
            headers={"Retry-After": "2"},
        )
    silent = replicas.never_listed_models()
    if silent:
        # Without a policy (or --model) the models come from the engines' /v1/models: while
        # one has never answered, "unknown" may only mean "not heard from yet".
        # Their ids, not their URLs: a client is not shown the fleet's addresses (or a
        # password in one); /admin/replicas and the gateway's log have them.
        where = ", ".join(str(r.replica_id) for r in silent[:3])
        raise GatewayError(
            503,
            errors.NO_HEALTHY_REPLICA,
            f"The model `{model}` is not served by any replica that has answered so far, and "
            f"{len(silent)} replica(s) have not listed their models yet ({where}); check that "
            "they are up, and their URLs (the engine's root, e.g. http://host:8000; "
            "GET /admin/replicas lists them).",
            "model",
            headers={"Retry-After": "2"},
        )
    raise model_not_found(model)


async def _prompt_or_degrade(
    tokenizer: PromptTokenizer, kind: RequestKind, model: str, body: Body, scope: str
) -> TokenizedPrompt:
    """Tokenize; a malformed message is the client's 400, a tokenizer outage degrades to text.
    ``scope``: the tenant's cache salt, which a tokenizer's cache is keyed on
    (``routing/tokenize/scope.py``)."""
    # Imported here, not at the top: ``routing.tokenize`` pulls in the tokenizer libraries
    # (~150 ms), which a gateway without a local or remote tokenizer never needs at start-up.
    from routing.tokenize import InvalidMessages, TextTokenizer
    from routing.tokenize.scope import TOKENIZE_CACHE_SCOPE

    TOKENIZE_CACHE_SCOPE.set(scope)  # this request's task only
    try:
        return await kind.prompt(tokenizer, model, body)
    except (InvalidMessages, ValueError, TypeError) as exc:
        message = f"Invalid prompt: {exc}"
        raise GatewayError(400, errors.INVALID_REQUEST, message, _faulty_field(exc, body)) from None
    except Exception as exc:  # remote tokenizer down: route on text blocks rather than fail
        log.warning("tokenizer failed (%s); routing on text blocks for this request", exc)
        return await kind.prompt(TextTokenizer(), model, body)


def _faulty_field(exc: Exception, body: Body) -> str:
    """The body field a tokenizer's error names first (``tools[0].function: ...``,
    ``chat_template_kwargs: ...``), for the envelope's ``param``; ``messages`` by default."""
    field = re.match(r"[A-Za-z_]+", str(exc))
    return field[0] if field and field[0] in body else "messages"


def prompt_units(prompt: TokenizedPrompt) -> int:
    """The prompt's length in tokens: exact with token ids, estimated in text mode.

    A text block is ``block_size * CHARS_PER_TOKEN`` characters and stands for ``block_size``
    tokens (``routing.hashing.prompt_chain``), so the estimate is characters / CHARS_PER_TOKEN
    (rounded up): ``matched_blocks * block_size`` and this length are then in the same units.
    """
    if prompt.token_ids is not None:
        return len(prompt.token_ids)
    return -(-len(prompt.text or "") // CHARS_PER_TOKEN)


def block_size_for(
    policy: GatewayPolicy, replicas: ReplicaRegistry, model: str, default: int
) -> int:
    """Hashing granularity: the policy's, else a serving replica's, else the configured default."""
    if model in policy.block_sizes:
        return policy.block_sizes[model]
    for state in replicas.all():
        if state.serves(model):
            return state.block_size
    return default


async def _pick_replica(
    gw: RouteDeps,
    request: RoutingRequest,
    matched_route: Route,
    only: frozenset[ReplicaId] | None = None,
) -> tuple[RoutingDecision, bool]:
    """The engine's decision (and whether it was a last resort), traced and measured; among
    ``only`` those replicas if given (then no last resort: ``NoReplicaAvailable`` instead)."""
    gw.registry.refresh_inflight(gw.inflight)
    replicas = gw.registry.routable()
    if only is not None:
        replicas = [replica for replica in replicas if replica.replica_id in only]
    adapters.fill_cold_load_estimates(gw.adapters, gw.registry, request, replicas)
    decide_start_ns = time.time_ns()
    last_resort = False
    with stage_span(gw.tracer, "fleetgate.route") as span:
        try:
            decision = await gw.engine.route(request, replicas, matched_route.profile)
        except NoReplicaAvailable as exc:
            if only is not None:
                raise
            decision = await _route_last_resort(gw, request, matched_route, exc)
            last_resort = True
        span.set_attribute("fleetgate.replica", decision.replica)
        span.set_attribute("fleetgate.degraded", decision.degraded)
        span.set_attribute("fleetgate.overflow", request.overflow)
        if not isinstance(gw.tracer, NullTracer):
            _stage_spans(gw.tracer, decide_start_ns, decision.timings_ms)
    # Overflow is counted once the request is sent (``count_sent``): flow control routes a
    # queued request again on every pass of its queue, 50 times a second.
    _decision_metrics(gw.metrics, gw.index_backend, matched_route.name, decision)
    return decision, last_resort


def count_sent(metrics: GatewayMetrics, routed: RouteDecision) -> None:
    """Count what a request's final decision was, once, as it is sent: as the simulator
    counts it at dispatch."""
    if routed.routing_request.overflow:
        metrics.overflow.labels(routed.route.name).inc()


def _stage_spans(tracer: Tracer, start_ns: int, timings: dict[str, float]) -> None:
    plugin_ms = sum(
        ms for key, ms in timings.items() if key.startswith(("filter:", "scorer:", "picker:"))
    )
    stages = {"index": timings["index"]} if "index" in timings else {}
    stages["scoring"] = plugin_ms
    record_stage_spans(
        tracer,
        start_ns,
        stages,
        {"index": "fleetgate.index_lookup", "scoring": "fleetgate.scoring"},
    )


async def _route_last_resort(
    gw: RouteDeps, request: RoutingRequest, matched_route: Route, cause: NoReplicaAvailable
) -> RoutingDecision:
    """No replica of the model is healthy: route among those that only missed health polls.

    503 only when none is left (none known, or every circuit open): degrade rather than fail.
    """
    replicas = gw.registry.last_resort(request.model)
    if not replicas:
        serving = any(
            r.healthy and request.model in r.models for r in gw.registry.routable()
        )
        raise _no_replica(request, cause, excluded_by_policy=serving)
    log.warning(
        "no healthy replica serves %s; last resort among %d that missed health polls",
        request.model,
        len(replicas),
    )
    gw.metrics.last_resort.labels(request.route).inc()
    adapters.fill_cold_load_estimates(gw.adapters, gw.registry, request, replicas)
    try:
        return await gw.engine.route(request, replicas, matched_route.profile)
    except NoReplicaAvailable as exc:  # e.g. a filter of the profile left none of them
        raise _no_replica(request, exc) from None


#: When the detail of the last "no replica" answer was logged: once per 10 s, not per request.
_no_replica_logged_at = -math.inf


def _no_replica(
    request: RoutingRequest, cause: NoReplicaAvailable, excluded_by_policy: bool = False
) -> GatewayError:
    """503 for a request no replica can take. The client hears which model; the routing
    detail (profile, filters, counts) is the operator's, in the log. ``excluded_by_policy``:
    healthy replicas serve the model, and the route's profile filtered every one out (a
    requirement none meets): no ``Retry-After``, since retrying soon changes nothing."""
    global _no_replica_logged_at
    now = time.monotonic()
    if now - _no_replica_logged_at >= 10.0:
        _no_replica_logged_at = now
        log.warning("answering 503 to request %s: %s", request.request_id, cause)
    if excluded_by_policy:
        return GatewayError(
            503,
            errors.NO_HEALTHY_REPLICA,
            f"No replica of model {request.model!r} meets what this request's route requires; "
            "the gateway's log says which requirement.",
        )
    return GatewayError(
        503,
        errors.NO_HEALTHY_REPLICA,
        f"No healthy replica serves model {request.model!r} right now; retry shortly.",
        headers={"Retry-After": "1"},
    )


def _decision_metrics(
    m: GatewayMetrics, index_backend: str, route_name: str, decision: RoutingDecision
) -> None:
    total_ms = decision.timings_ms.get("total")
    if total_ms is not None:
        m.decision_seconds.labels(decision.profile).observe(total_ms / 1000)
    index_ms = decision.timings_ms.get("index")
    if index_ms is not None:
        m.index_lookup_seconds.labels(index_backend).observe(index_ms / 1000)
    if decision.degraded:
        m.degraded.labels(route_name, "index_unavailable").inc()
        m.index_errors.labels(index_backend).inc()
