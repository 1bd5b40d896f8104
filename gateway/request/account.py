"""Phase 3 of a request: account for it, once the answer is on its way.

Metrics, the index-prediction check, TTFT calibration, cost and hit rate, the prompt-layout
detector, and one ``DecisionRecord`` appended to the decision log (``/admin/decisions``). Reads the
route phase's ``RouteDecision`` and the forward phase's ``UpstreamOutcome``; never raises.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from gateway import errors
from gateway.cost import RouteWindow
from gateway.layout import LayoutDiagnostics
from gateway.metrics import GatewayMetrics
from gateway.policy_view import Route
from gateway.proxy import UpstreamOutcome
from gateway.replicas import ReplicaRegistry
from gateway.request.record import CachePrediction, DecisionRecord
from gateway.request.route import PINNED_PROFILE, RouteDecision
from gateway.routing_glue import Router
from gateway.speculative import SpeculativeTarget, SpeculativeWriter
from routing.hashing import chain_seed
from routing.types import ReplicaId

log = logging.getLogger(__name__)


@runtime_checkable
class AccountDeps(Protocol):
    """What the account phase writes to (``GatewayState`` is one)."""

    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def window(self) -> RouteWindow: ...
    @property
    def engine(self) -> Router: ...
    @property
    def layout(self) -> LayoutDiagnostics: ...
    @property
    def decisions(self) -> deque[DecisionRecord]: ...
    @property
    def speculative(self) -> SpeculativeWriter: ...
    @property
    def speculative_target(self) -> SpeculativeTarget: ...
    @property
    def registry(self) -> ReplicaRegistry: ...


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def completion_tokens_of(usage: Mapping[str, Any] | None) -> int:
    """``usage.completion_tokens``, or 0 when the answer reported none."""
    return _int(usage.get("completion_tokens")) if isinstance(usage, Mapping) else 0


def cached_tokens_of(usage: Mapping[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, or None when the engine does not report it."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, Mapping) or details.get("cached_tokens") is None:
        return None
    return _int(details.get("cached_tokens"))


def prediction_outcome(predicted: int, actual: int, block_size: int) -> str:
    """``exact`` within one block (engines cache whole blocks), else ``over`` / ``under``."""
    if abs(predicted - actual) < max(1, block_size):
        return "exact"
    return "over" if predicted > actual else "under"


def account(
    gw: AccountDeps,
    routed: RouteDecision,
    outcome: UpstreamOutcome,
    arrived: float,
    streamed: bool,
) -> None:
    """Record everything about one finished (or failed) request. Never raises.

    Runs as a loop callback right after the handler returns (``handler.handle``): aiohttp has
    written the response by then, so none of this adds to the client's latency, and it is still
    done before this gateway reads the client's next request.
    """
    try:
        _account(gw, routed, outcome, arrived, streamed)
    except Exception:  # accounting must never turn a served request into an error
        log.exception("accounting failed for request %s", routed.routing_request.request_id)
    try:
        request = routed.routing_request
        # Seeded like the chain: tenants with different salts sharing a template is isolation,
        # not a cache-busting layout.
        seed = chain_seed(request.model, request.adapter, routed.tenant.cache_salt)
        gw.layout.observe(routed.route.name, routed.prompt, request.chain, routed.block_size, seed)
    except Exception:  # a detector must never disturb serving
        log.exception("prompt layout detector failed")


def _account(
    gw: AccountDeps,
    routed: RouteDecision,
    outcome: UpstreamOutcome,
    arrived: float,
    streamed: bool,
) -> None:
    m = gw.metrics
    replica_seconds = outcome.replica_seconds
    route, model = routed.route.name, routed.base_model
    replica = outcome.replica or "none"
    # 499: nginx's "client closed request", the de-facto code for an abandoned request.
    status = 499 if outcome.client_gone else outcome.status
    m.requests.labels(route, model, replica, str(status)).inc()
    if status >= 500 and outcome.error_code is None:
        # The replica's own 5xx, relayed as it was (no fallback left), or a stream that broke
        # off after its first bytes: errors too, though the gateway raised none of its own.
        m.errors.labels(route, errors.UPSTREAM_ERROR).inc()
    end = outcome.finished_at or time.monotonic()
    m.e2e.labels(route, model).observe(end - arrived)
    for pool, seconds in replica_seconds.items():
        m.replica_seconds.labels(route, pool).inc(seconds)
    ok = status == 200 and not outcome.client_gone
    usage = outcome.usage or {}
    prompt_tokens = _int(usage.get("prompt_tokens"))
    completion_tokens = completion_tokens_of(usage)
    cached = cached_tokens_of(usage)
    ttft_ms = None
    if outcome.ttft_s is not None:
        # TTFT as the client sees it: from arrival at the gateway, not from the upstream send.
        ttft = outcome.ttft_s + ((outcome.sent_at or arrived) - arrived)
        ttft_ms = ttft * 1000
        m.ttft.labels(route, model).observe(ttft)
        # The events of ``n`` answers come interleaved: each answer's tokens are n events apart.
        choices = routed.routing_request.choices
        for gap in outcome.gaps_s:
            m.itl.labels(route, model).observe(gap * choices)
        tpot_ms = outcome.tpot_ms(completion_tokens, choices)
        if tpot_ms is not None:
            m.tpot.labels(route, model).observe(tpot_ms / 1000.0)
    if ok:
        m.prompt_tokens.labels(route, model).inc(prompt_tokens)
        m.completion_tokens.labels(route, model).inc(completion_tokens)
        if cached is not None:
            m.cached_tokens.labels(route, model).inc(cached)
        pool = next(iter(replica_seconds), "unknown")
        if prompt_tokens:  # no usage, no lengths: a zero would drag the percentiles down
            m.request_prompt_tokens.labels(route, pool).observe(prompt_tokens)
            m.request_output_tokens.labels(route, pool).observe(completion_tokens)
            m.request_context_tokens.labels(route, pool).observe(prompt_tokens + completion_tokens)
            budget = routed.routing_request.max_output_tokens
            if budget is not None:
                m.request_budget_tokens.labels(route, pool).observe(prompt_tokens + budget)
        gw.window.add(
            route,
            pool,
            sum(replica_seconds.values()),
            prompt_tokens,
            cached or 0,
            completion_tokens,
        )
    _slo(gw, routed, ttft_ms, outcome, completion_tokens, status, streamed, end - arrived)
    prediction = _prediction(gw, routed, outcome, prompt_tokens, cached)
    gw.decisions.append(_record(routed, outcome, prediction, status, cached, ttft_ms))
    if outcome.replica is not None:
        gw.engine.observe_complete(
            routed.routing_request,
            outcome.replica,
            _decided_ttft_ms(routed, outcome)
            if streamed
            else _unstreamed_ttft_ms(gw, routed, outcome, completion_tokens),
            cached_in_routing_units(routed, cached, prompt_tokens),
            ok,
        )


def cached_in_routing_units(
    routed: RouteDecision, cached: int | None, prompt_tokens: int | None
) -> int | None:
    """The engine's cached tokens in the units routing counted the prompt in.

    Routing calibrates prefill speed from the uncached part of the prompt, its own count less
    the cached. In text mode its count is an estimate (4 characters a token) and the engine's
    is real: subtracting one from the other overstated the uncached tokens (the more so the more
    was cached), and learned speeds 3-5 times too fast, by different factors per pool (the
    heterogeneous-fleet review). The engine's cached share of its own count, applied to
    routing's, keeps one unit on both sides."""
    scale = _engine_tokens_per_unit(routed, prompt_tokens)
    if cached is None or scale is None:
        return cached
    estimated = routed.routing_request.prompt_tokens
    return min(estimated, round(cached * estimated / prompt_tokens))


def _engine_tokens_per_unit(routed: RouteDecision, prompt_tokens: int | None) -> float | None:
    """The engine's tokens per token routing counted, where routing's count is text mode's
    estimate (a block of ``block_size * CHARS_PER_TOKEN`` characters counts ``block_size``
    tokens); None where it counted the engine's own tokens or either count is missing."""
    estimated = routed.routing_request.prompt_tokens
    if routed.prompt.token_ids is not None or not estimated or not prompt_tokens:
        return None
    return prompt_tokens / estimated


def _decided_ttft_ms(routed: RouteDecision, outcome: UpstreamOutcome) -> float | None:
    """The TTFT routing predicted, as it happened: from the decision that sent the request (a
    request flow control held is decided again at its release) to its first token. The client's
    TTFT also counts the wait before that decision, which no replica choice changes: learned as
    prefill time, it would make every replica look slower the longer the gateway queue is."""
    if outcome.ttft_s is None or outcome.sent_at is None or outcome.attempts > 1:
        # A retry's fallback was predicted at the first decision; the failed attempt's time is
        # not its prefill, so it teaches nothing (before: the fallback learned it as slowness).
        return None
    return max(0.0, outcome.sent_at + outcome.ttft_s - routed.decided_at) * 1000.0


#: A non-streamed answer calibrates only while its estimated decode is at most this share of its
#: time: past it, the error of the decode estimate would swamp the prefill it is meant to measure.
UNSTREAMED_MAX_DECODE_SHARE = 0.5


def _unstreamed_ttft_ms(
    gw: AccountDeps, routed: RouteDecision, outcome: UpstreamOutcome, completion_tokens: int
) -> float | None:
    """A non-streamed answer's TTFT, estimated for calibration: its time from the decision
    less its decode, at the engine's recent inter-token latency (exact for a one-token answer).

    The gateway sees no first token when the client does not stream. Without this, a fleet of
    non-streaming clients (batch jobs, agents' tool calls) never calibrated its prefill speed:
    it stayed at the configured figure, 2-3x off on an H100 at the 10,000 tokens/s default.
    None where it cannot tell: a retried request (as ``_decided_ttft_ms``), a background
    Response (settled when a 1 s poll saw it end), an engine without a recent inter-token
    latency, or a long answer whose decode would be most of its time.
    """
    if outcome.sent_at is None or outcome.finished_at is None or outcome.attempts > 1:
        return None
    if outcome.settled_later or outcome.replica is None or completion_tokens < 1:
        return None
    total_ms = max(0.0, outcome.finished_at - routed.decided_at) * 1000.0
    if completion_tokens == 1:
        return total_ms
    state = gw.registry.get(outcome.replica)
    itl_ms = state.decode_itl_ms if state is not None else None
    if itl_ms is None or not math.isfinite(itl_ms):
        return None
    # ``n`` answers decode side by side: the time of one answer's tokens.
    per_answer = max(1, completion_tokens // routed.routing_request.choices)
    decode_ms = (per_answer - 1) * itl_ms
    if decode_ms > UNSTREAMED_MAX_DECODE_SHARE * total_ms:
        return None
    return total_ms - decode_ms


def record_refusal(gw: AccountDeps, routed: RouteDecision, status: int, code: str) -> None:
    """A request routed, then answered by the gateway itself (shed, over its token budget,
    ...): in the decision log too, so that a client's "my request got a 429" can be looked up
    by its request id."""
    gw.decisions.append(
        replace(_record(routed, UpstreamOutcome(), None, status, None, None), error=code)
    )


def _record(
    routed: RouteDecision,
    outcome: UpstreamOutcome,
    prediction: CachePrediction | None,
    status: int,
    cached: int | None,
    ttft_ms: float | None,
) -> DecisionRecord:
    decision = routed.decision
    request = routed.routing_request
    return DecisionRecord(
        at=routed.routed_at,
        request_id=request.request_id,
        route=routed.route.name,
        tenant=routed.tenant.name,
        model=routed.base_model,
        adapter=routed.adapter,
        prompt_tokens=request.prompt_tokens,
        blocks=len(request.chain),
        replica=decision.replica,
        fallbacks=tuple(decision.fallbacks),
        profile=decision.profile,
        degraded=decision.degraded,
        last_resort=routed.last_resort,
        timings_ms=decision.timings_ms,
        explanations=decision.explanations,
        adapter_load=outcome.adapter_load,
        prediction=prediction,
        status=status,
        served_by=outcome.replica,
        cached_tokens=cached,
        ttft_ms=ttft_ms,
    )


def _slo(
    gw: AccountDeps,
    routed: RouteDecision,
    ttft_ms: float | None,
    outcome: UpstreamOutcome,
    completion_tokens: int,
    status: int,
    streamed: bool,
    elapsed_s: float,
) -> None:
    """``fleetgate_slo_requests_total`` for one request (docs/metrics.md, *SLO accounting*).

    ``slo="all"`` (goodput) counts every request that was routed and did not end in a client
    error: met when it succeeded and met each SLO it could be checked against, missed when it
    failed (5xx, timeout, broken stream) or missed one. A client that left (499) is a miss
    when it had already missed an SLO, and otherwise not counted: it did not succeed, and it
    is not the fleet's failure either. ``ttft`` / ``tpot`` count where they can
    be measured: a streamed request that failed before its first token missed its TTFT, and so
    did one whose client left (499) before it, having waited longer than the SLO.
    """
    route = routed.route
    failed = status >= 500
    gone = outcome.client_gone
    succeeded = status == 200 and not gone
    checks: dict[str, bool] = {}
    if route.ttft_slo_ms is not None:
        if ttft_ms is not None:
            checks["ttft"] = ttft_ms <= route.ttft_slo_ms
        elif streamed and (failed or (gone and elapsed_s * 1000 > route.ttft_slo_ms)):
            checks["ttft"] = False  # no first token: the client waited past the SLO, or for none
    choices = routed.routing_request.choices
    tpot_ms = outcome.tpot_ms(completion_tokens, choices) if succeeded else None
    if route.tpot_slo_ms is not None and tpot_ms is not None:
        checks["tpot"] = tpot_ms <= route.tpot_slo_ms
    if route.ttft_slo_ms is None and route.tpot_slo_ms is None:
        return  # no objective to measure against (no `all` series either)
    if failed:
        met_all: bool | None = False
    elif gone:
        # Left after a first token in time was still "met" (the metrics review): not a success.
        met_all = False if not all(checks.values()) else None
    elif checks:
        met_all = all(checks.values())
    elif succeeded:
        met_all = True  # nothing measurable (not streamed, one token): served is what counts
    else:
        met_all = None  # a client error (4xx), or a client that left early: not ours to count
    if met_all is not None:
        # Per SLO (the TTFT burn-rate alerts read slo="ttft") and for both together (goodput).
        checks["all"] = met_all
    for slo, met in checks.items():
        gw.metrics.slo_requests.labels(route.name, slo, "met" if met else "missed").inc()


def count_failed_before_forwarding(metrics: GatewayMetrics, route: Route, stream: bool) -> None:
    """A routed request the gateway failed (5xx) before sending it anywhere (no healthy replica,
    an adapter that cannot load): a miss for goodput, and for TTFT when it asked to stream."""
    if route.ttft_slo_ms is None and route.tpot_slo_ms is None:
        return
    misses = ["all", "ttft"] if stream and route.ttft_slo_ms is not None else ["all"]
    for slo in misses:
        metrics.slo_requests.labels(route.name, slo, "missed").inc()


def _prediction(
    gw: AccountDeps,
    routed: RouteDecision,
    outcome: UpstreamOutcome,
    prompt_tokens: int,
    cached: int | None,
) -> CachePrediction | None:
    """Compare the index's prediction with the engine's ``cached_tokens``; refresh on a miss."""
    if outcome.replica is None or cached is None or not prompt_tokens:
        return None
    if routed.decision.profile == PINNED_PROFILE:
        return None  # the index was not asked (a stored response's replica): nothing to check
    explanation = routed.decision.explanations.get(outcome.replica)
    # Tokens, in text mode estimated: rescaled to the engine's count of this prompt.
    matched_units = (explanation.matched_blocks if explanation else 0) * routed.block_size
    estimated = routed.routing_request.prompt_tokens
    scale = _engine_tokens_per_unit(routed, prompt_tokens) or 1.0
    predicted = round(min(matched_units, estimated) * scale)
    if routed.prompt.token_ids is not None:
        # vLLM computes a prompt's last token even when every block is cached (it needs its
        # logits), so a fully matched block-aligned prompt reports one block less.
        predicted = min(predicted, (prompt_tokens - 1) // routed.block_size * routed.block_size)
    block_tokens = max(1, round(routed.block_size * scale))
    result = prediction_outcome(predicted, cached, block_tokens)
    route = routed.route.name
    gw.metrics.predicted_cached.labels(route).inc(predicted)
    gw.metrics.cache_prediction.labels(route, result).inc()
    if result != "exact" and outcome.replica != routed.decision.replica:
        # The index was wrong about this replica; the engine now holds the whole prompt, so
        # write the whole chain for it (with the speculative TTL) rather than trust the stale
        # entry. The chosen replica needs no refresh: the speculative write covered it (same
        # TTL) moments ago, so only a fallback that served the request is written.
        gw.speculative.start(
            gw.speculative_target, ReplicaId(outcome.replica), routed.routing_request.chain, 0
        )
    return CachePrediction(predicted, result)
