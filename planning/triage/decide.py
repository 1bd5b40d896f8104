"""The symptom-to-lever decision chart: pure, no I/O, one route at a time.

Rules run in this order, and levers keep the order the rules add them in:

1. TTFT p95 over SLO → prefix caching with prefix-aware routing (when more than 30% of prompt
   tokens are a shared prefix), then queueing (replicas, admission control), then chunked
   prefill or prefill/decode disaggregation.
2. The KV cache limits (any preemption, or usage at or over 90% while requests wait: the
   definition ``fleetgate advise`` uses, ``planning.kv_pressure``) → FP8 KV cache, then FP8/INT4
   weights.
3. TPOT p95 over SLO → weight quantization if quality headroom is declared, else a smaller
   max batch, more replicas or speculative decoding.
4. More than 3 fine-tuned variants → LoRA adapters on one base model.
5. None of these → within SLO: look at capacity headroom and cost, not tuning. The lever says
   which: ``within SLO`` when an SLO was checked and met, ``SLO not checked`` when only other
   signals were known, ``no signals`` when no rule could be checked (unknown is not healthy).

Failure modes that the signals reveal are folded into the lever they call for: a cache-busting
prompt layout (a prefix-caching lever, whether or not TTFT is over SLO) and capacity planned from
averages (in the queueing lever's reason).
"""

from __future__ import annotations

from planning.kv_pressure import KV_PINNED, kv_pinned, pressure_reasons
from planning.triage.model import Lever, RouteMetrics

SHARED_PREFIX_THRESHOLD = 0.30
LORA_VARIANTS_THRESHOLD = 3
#: Average utilisation below this, with p95 TTFT over SLO, means bursts, not the mean, queue.
LOW_UTILISATION = 0.60
#: Average utilisation at or above this leaves no room for bursts.
HIGH_UTILISATION = 0.80
#: More than this share of requests missing an SLO is a p95 over it.
SLO_MISS_SHARE = 0.05
#: Flow control refusing this share of requests or more means the fleet is undersized.
SHED_SIGNIFICANT = 0.01

QUANTIZE_WEIGHTS = "quantize weights to FP8 (vLLM --quantization fp8) or INT4"
FIX_LAYOUT = "fix the cache-busting prompt layout"
WITHIN_SLO = "within SLO: review capacity headroom and cost per 1M tokens instead of tuning"
SLO_NOT_CHECKED = (
    "no rule fired, but no latency SLO was checked: review capacity headroom and cost per 1M tokens"
)
NO_SIGNALS = "no signals: not checked, cannot judge this route"


def triage(metrics: RouteMetrics) -> list[Lever]:
    """Ordered levers for one route; see the module docstring for the chart."""
    levers: list[Lever] = []
    shed = metrics.shed_share
    shedding = shed is not None and shed >= SHED_SIGNIFICANT
    ttft_over = _over(metrics.ttft_p95_ms, metrics.ttft_slo_ms, metrics.ttft_slo_missed)
    if shedding:
        assert shed is not None
        breach = (
            _breach("TTFT", metrics.ttft_p95_ms, metrics.ttft_slo_ms, metrics.ttft_slo_missed)
            if ttft_over
            else None
        )
        _add(levers, _shedding(shed, breach))
    if ttft_over:
        _add(levers, _prefix_caching(metrics))
        _add(levers, _queueing(metrics))
        _add(
            levers,
            Lever(
                "queueing",
                "chunked prefill or prefill/decode disaggregation",
                "long prompts' prefills stall the batch and everyone's first token behind "
                "them; chunk prefills (vLLM --enable-chunked-prefill, smaller "
                "--max-num-batched-tokens) or move prefill to its own replicas",
            ),
        )
    kv_rule = _kv_pressure(metrics)
    if kv_rule is not None:
        _add(
            levers,
            Lever(
                "kv-quantization",
                "FP8 KV cache",
                f"{kv_rule}; an FP8 KV cache (vLLM --kv-cache-dtype fp8) halves the bytes per "
                "cached token, so twice the sequences fit before preemption",
            ),
        )
        _add(
            levers,
            Lever(
                "weight-quantization",
                QUANTIZE_WEIGHTS,
                f"{kv_rule}; smaller weights free HBM for the KV cache (an 8B model: 16 GB in "
                "BF16, 8 GB in FP8, 4 GB in INT4)",
            ),
        )
    if _over(metrics.tpot_p95_ms, metrics.tpot_slo_ms, metrics.tpot_slo_missed):
        tpot = _breach("TPOT", metrics.tpot_p95_ms, metrics.tpot_slo_ms, metrics.tpot_slo_missed)
        if metrics.quality_headroom:
            _add(
                levers,
                Lever(
                    "weight-quantization",
                    QUANTIZE_WEIGHTS,
                    f"{tpot}; decode is memory-bound, so fewer weight bytes per step cut TPOT "
                    "almost proportionally, and quality headroom is declared",
                ),
            )
        else:
            _add(
                levers,
                Lever(
                    "reduce-batch",
                    "lower max batch size, add replicas, or speculative decoding",
                    f"{tpot}; each decode step reads every running sequence's KV, so a smaller "
                    "--max-num-seqs (with replicas to carry the load) shortens steps; no quality "
                    "headroom is declared, so weights stay unquantized",
                ),
            )
    variants = metrics.fine_tuned_variants
    if variants is not None and variants > LORA_VARIANTS_THRESHOLD:
        _add(
            levers,
            Lever(
                "multi-lora",
                "serve the fine-tunes as LoRA adapters on one base model",
                f"{variants} fine-tuned variants (more than {LORA_VARIANTS_THRESHOLD}): served as "
                "full models, each holds its own copy of the base weights and its own mostly idle "
                "replicas; one base with adapters (vLLM --enable-lora, --max-loras) pools the "
                "traffic, and fleetgate routes to replicas with the adapter resident",
            ),
        )
    rules_fired = bool(levers)
    if metrics.cache_busting_layout and not ttft_over:
        # Within the TTFT SLO the layout still burns prefill compute on every request.
        _add(levers, _fix_layout("TTFT is within SLO, but every request pays a full prefill"))
    if not rules_fired:
        levers.append(_headroom(metrics))
    return levers


#: How to give triage a route's SLO, in a message about the one it lacks.
_NO_SLO = (
    "declare the route's `slo` in the policy (the gateway then exports it), or pass "
    "--{slo}-slo-ms (`{slo}_slo_ms` in an --input file)"
)


def unchecked(metrics: RouteMetrics) -> list[str]:
    """Rules that could not be evaluated because their inputs are unknown."""
    missing = []
    if metrics.ttft_p95_ms is None:
        missing.append(
            "TTFT (needs ttft_p95_ms; a gateway measures it on streamed requests only)"
        )
    elif metrics.ttft_slo_ms is None:
        missing.append(f"TTFT (no SLO to check it against: {_NO_SLO.format(slo='ttft')})")
    if metrics.kv_cache_usage is None and metrics.preemptions_per_min is None:
        missing.append(
            "KV pressure (needs kv_cache_usage or preemptions_per_min: engine figures, from "
            "--prometheus or an --input file)"
        )
    elif (
        (metrics.kv_cache_usage or 0) >= KV_PINNED
        and not metrics.preemptions_per_min
        and metrics.waiting_mean is None
        and metrics.waiting_growth_per_min is None
    ):
        missing.append(
            "KV pressure at this usage (needs waiting_mean or waiting_growth_per_min: a full "
            "cache limits only while requests wait or the queue grows)"
        )
    if metrics.tpot_p95_ms is None:
        missing.append(
            "TPOT (needs tpot_p95_ms; a gateway measures it on streamed requests only)"
        )
    elif metrics.tpot_slo_ms is None:
        missing.append(f"TPOT (no SLO to check it against: {_NO_SLO.format(slo='tpot')})")
    if metrics.fine_tuned_variants is None:
        missing.append("fine-tunes (needs fine_tuned_variants)")
    return missing


def _over(value: float | None, slo: float | None, missed: float | None = None) -> bool:
    """Over SLO: more than 5% of requests missed it where the gateway counted them (exact),
    else the p95 (read from histogram buckets) is over it."""
    if slo is None:
        return False
    if missed is not None:
        return missed > SLO_MISS_SHARE
    return value is not None and value > slo


def _breach(name: str, p95: float | None, slo: float | None, missed: float | None) -> str:
    """How ``name`` is over its SLO, in words."""
    if missed is not None:
        approx = f" (p95 about {p95:,.0f} ms)" if p95 is not None else ""
        return f"{missed:.0%} of requests missed the {slo:,g} ms {name} SLO{approx}"
    return f"{name} p95 {p95:,.0f} ms is over its {slo:,g} ms SLO"


def _shedding(shed: float, breach: str | None = None) -> Lever:
    also = f"{breach} even so; " if breach else ""
    return Lever(
        "queueing",
        "add replicas",
        f"flow control refused {shed:.0%} of standard requests (429, fleet-wide: every route "
        f"shares the engines) because the fleet was saturated; {also}"
        "the latencies here are the admitted requests' only, so they understate the overload. "
        "Admission control is already on: the fleet is too small for this load (size it with "
        "`fleetgate plan capacity`), or lower the traffic it promises",
    )


def _add(levers: list[Lever], lever: Lever | None) -> None:
    """Append, or merge the reason into an earlier lever that is the same change."""
    if lever is None:
        return
    for index, existing in enumerate(levers):
        if (existing.category, existing.action) == (lever.category, lever.action):
            levers[index] = Lever(
                existing.category, existing.action, f"{existing.why}; also {lever.why}"
            )
            return
    levers.append(lever)


def _fix_layout(consequence: str) -> Lever:
    return Lever(
        "prefix-caching",
        FIX_LAYOUT,
        "the gateway sees shared content behind a unique first block (e.g. a timestamp or "
        f"request id at the top of the system prompt), so no prefix is ever reused; {consequence}. "
        "Move per-request values to the end of the prompt, then use prefix caching with "
        "prefix-aware routing",
    )


def _prefix_caching(metrics: RouteMetrics) -> Lever | None:
    if metrics.cache_busting_layout:
        return _fix_layout("TTFT pays a full prefill on every request")
    shared = metrics.shared_prefix_fraction
    if shared is None or shared <= SHARED_PREFIX_THRESHOLD:
        return None
    return Lever(
        "prefix-caching",
        "prefix caching with prefix-aware routing",
        f"{shared:.0%} of prompt tokens are a shared prefix (over "
        f"{SHARED_PREFIX_THRESHOLD:.0%}); with vLLM --enable-prefix-caching and a prefix-aware "
        "policy (expected-ttft) those tokens skip prefill on the replica that holds them",
    )


def _queueing(metrics: RouteMetrics) -> Lever | None:
    if metrics.shed_share is not None and metrics.shed_share >= SHED_SIGNIFICANT:
        return None  # said by the shedding lever, breach included
    ttft = _breach("TTFT", metrics.ttft_p95_ms, metrics.ttft_slo_ms, metrics.ttft_slo_missed)
    utilisation = metrics.utilisation
    if utilisation is None:
        why = (
            f"{ttft}; check utilisation: if replicas are busy, requests wait before prefill. "
            "Add replicas (size with `fleetgate plan capacity`) and admission control"
        )
    elif utilisation < LOW_UTILISATION:
        why = (
            f"{ttft} while replicas are busy only {utilisation:.0%} of the time: capacity "
            "planned from averages; bursts queue even when the mean looks idle. Size for p95 "
            "TTFT at the busiest window's rate (`fleetgate plan capacity`), and add admission "
            "control"
        )
    elif utilisation >= HIGH_UTILISATION:
        why = (
            f"{ttft} with replicas busy {utilisation:.0%} of the time (some request running: "
            "not how full their batches are): requests likely queue for the engines; add "
            "replicas (size with `fleetgate plan capacity`) and shed or queue excess load "
            "with admission control (flow control)"
        )
    else:
        why = (
            f"{ttft} with replicas busy {utilisation:.0%} of the time; queueing grows fast "
            "from here: add replicas (`fleetgate plan capacity`) and admission control"
        )
    return Lever("queueing", "add replicas and admission control", why)


def _kv_pressure(metrics: RouteMetrics) -> str | None:
    """The reason when the KV cache limits (advise's definition, ``planning.kv_pressure``)."""
    figures = (
        metrics.kv_cache_usage,
        metrics.preemptions_per_min,
        metrics.waiting_mean,
        metrics.waiting_growth_per_min,
    )
    if not kv_pinned(*figures):
        return None
    return f"the KV cache limits ({pressure_reasons(*figures)})"


def _headroom(metrics: RouteMetrics) -> Lever:
    facts = []
    if metrics.ttft_slo_missed is not None:  # the exact count; the p95 is interpolated
        facts.append(f"{metrics.ttft_slo_missed:.1%} missed the {metrics.ttft_slo_ms:,g} ms "
                     "TTFT SLO")
    elif metrics.ttft_p95_ms is not None and metrics.ttft_slo_ms is not None:
        spare = 1 - metrics.ttft_p95_ms / metrics.ttft_slo_ms
        facts.append(
            f"TTFT p95 {metrics.ttft_p95_ms:,.0f} ms vs {metrics.ttft_slo_ms:,g} ms SLO "
            f"({spare:.0%} headroom)"
        )
    if metrics.tpot_slo_missed is not None:
        facts.append(f"{metrics.tpot_slo_missed:.1%} missed the {metrics.tpot_slo_ms:,g} ms "
                     "TPOT SLO")
    elif metrics.tpot_p95_ms is not None and metrics.tpot_slo_ms is not None:
        facts.append(
            f"TPOT p95 {metrics.tpot_p95_ms:,.1f} ms vs {metrics.tpot_slo_ms:,g} ms SLO"
        )
    if metrics.utilisation is not None:
        facts.append(f"replicas busy {metrics.utilisation:.0%} of the time")
    if metrics.shed_share is not None:
        facts.append(f"flow control refused {metrics.shed_share:.1%}")
    missing = unchecked(metrics)
    summary = "; ".join(facts) if facts else "no rule fired"
    if missing:
        summary += f" (not checked: {', '.join(missing)})"
    if not _any_signal(metrics):
        return Lever(
            "capacity-headroom",
            NO_SIGNALS,
            f"no rule could be checked ({', '.join(missing)}); unknown is not healthy: give "
            "the route's latencies and SLOs, KV usage or preemptions (--input, --gateway or "
            "--prometheus)",
            state="no signals",
        )
    slo_checked = any(
        value is not None and slo is not None
        for value, slo in (
            (metrics.ttft_p95_ms, metrics.ttft_slo_ms),
            (metrics.tpot_p95_ms, metrics.tpot_slo_ms),
        )
    )
    return Lever(
        "capacity-headroom",
        WITHIN_SLO if slo_checked else SLO_NOT_CHECKED,
        f"{summary}. See whether fewer replicas still meet the SLO (`fleetgate plan capacity`) "
        "and track fleetgate_cost_per_1m_tokens_usd",
        state="within SLO" if slo_checked else "SLO not checked",
    )


def _any_signal(metrics: RouteMetrics) -> bool:
    """True when at least one rule's inputs are known (else "no rule fired" means nothing)."""
    m = metrics
    return (
        (m.ttft_p95_ms is not None and m.ttft_slo_ms is not None)
        or (m.tpot_p95_ms is not None and m.tpot_slo_ms is not None)
        or any(
            value is not None
            for value in (
                m.kv_cache_usage,
                m.preemptions_per_min,
                m.fine_tuned_variants,
                m.utilisation,
                m.cache_busting_layout,
            )
        )
    )
