"""Per-policy figures from raw outcomes: hit rate, latency percentiles, goodput, cost, balance."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from planning.simulator.loop import PolicyRun, RequestOutcome
from routing.flow_control import RequestClass
from routing.policies import registry

__all__ = [
    "JSON_FIELDS",
    "SUMMARY_FIELDS",
    "PolicySummary",
    "Spread",
    "default_policy",
    "summarize",
]

#: The fields of ``PolicySummary.as_json``, in order (one object per policy and run).
SUMMARY_FIELDS = (
    "policy",
    "requests",
    "rejected",
    "prefix_hit_rate",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p95_ms",
    "queue_p95_ms",
    "goodput",
    "output_tok_s",
    "cost_per_1m_usd",
    "load_imbalance",
    "preemptions",
    "overflow",
    "flow_control",
    "flow_control_blind",
    "goodput_by_class",
    "requests_by_class",
    "shed",
    "shed_by_class",
    "queued",
    "steered",
    "gateway_wait_p50_ms",
    "gateway_wait_p95_ms",
    "gateway_wait_max_ms",
)

#: The ``fleetgate simulate --json`` field names, in order: a summary plus the rate scale it was
#: measured at and whether the policy is the gateway's default (so tooling can find it by flag,
#: not by a name that changes when the default does).
JSON_FIELDS = ("policy", "rate_scale", "default", *SUMMARY_FIELDS[1:])


def default_policy() -> str:
    """The built-in profile ``fleetgate serve`` and ``fleetgate up`` route with by default.

    Read at call time from the registry, never copied: the default changes by editing one line.
    """
    return registry.DEFAULT_PROFILE


@dataclass(frozen=True)
class PolicySummary:
    """One row of the report. Ceiling rows set only ``policy`` and ``prefix_hit_rate``."""

    policy: str
    requests: int | None
    #: Cached prompt tokens / prompt tokens, as the engines counted them.
    prefix_hit_rate: float
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    ttft_p99_ms: float | None = None
    #: Time per output token after the first: (finish - first token) / (output tokens - 1).
    tpot_p50_ms: float | None = None
    tpot_p95_ms: float | None = None
    #: Arrival to first scheduling by the engine.
    queue_p95_ms: float | None = None
    #: Share of requests meeting both the TTFT and the TPOT SLO.
    goodput: float | None = None
    output_tok_s: float | None = None
    #: Fleet cost over the run (replicas x price x makespan) per million output tokens.
    cost_per_1m_usd: float | None = None
    #: Max / mean requests routed per replica (1.0 = perfectly even).
    load_imbalance: float | None = None
    preemptions: int | None = None
    #: Requests the policy routed as overflow (predicted to miss the TTFT SLO on every replica).
    overflow: int = 0
    #: Requests the engines refused (e.g. longer than the model's context): in neither
    #: ``requests`` (those served) nor goodput.
    rejected: int = 0
    #: Whether the run had flow control at the gateway (``--flow-control on``).
    flow_control: bool = False
    #: ... and the policy predicts no TTFT for it to judge by, so it admitted everything: the
    #: row is this policy without flow control, whatever ``flow_control`` says.
    flow_control_blind: bool = False
    #: Goodput per request class; refused requests count as misses of their class.
    goodput_by_class: dict[str, float] | None = None
    #: Requests per class that ``goodput_by_class`` is over: served and refused by flow control
    #: (not those the engines refused), so the overall goodput can be rebuilt from the classes.
    requests_by_class: dict[str, int] | None = None
    #: Requests flow control refused (429 at a live gateway), in all and per class.
    shed: int = 0
    shed_by_class: dict[str, int] | None = None
    #: Requests that waited in the gateway queue.
    queued: int = 0
    #: Requests flow control moved off a replica whose decodes were too slow (critical ones,
    #: and others it would have held on a calm fleet).
    steered: int = 0
    #: Time in the gateway queue, over every request (0 for those never queued).
    gateway_wait_p50_ms: float | None = None
    gateway_wait_p95_ms: float | None = None
    gateway_wait_max_ms: float | None = None

    def as_json(self) -> dict[str, object]:
        """The row as a JSON object with exactly ``SUMMARY_FIELDS``; NaN becomes null."""
        row = asdict(self)
        return {
            name: None if isinstance(row[name], float) and math.isnan(row[name]) else row[name]
            for name in SUMMARY_FIELDS
        }


@dataclass(frozen=True)
class Spread:
    """One figure over several runs (seeds): its mean and its min–max range."""

    mean: float
    low: float
    high: float
    #: Runs that had the figure (runs where it was None or NaN are left out).
    count: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        """The spread of ``values``, ignoring None and NaN; all NaN when nothing is left."""
        kept = [v for v in values if v is not None and not math.isnan(v)]
        if not kept:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(sum(kept) / len(kept), min(kept), max(kept), len(kept))


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def summarize(run: PolicyRun, slo_ttft_ms: float, slo_tpot_ms: float) -> PolicySummary:
    """The report row of one policy run."""
    outcomes: Sequence[RequestOutcome] = run.outcomes
    shed_by_class: dict[str, int] = {}
    for shed in run.shed:
        shed_by_class[shed.request_class.value] = shed_by_class.get(shed.request_class.value, 0) + 1
    if not outcomes:
        shed_waits = np.array([s.waited_s * 1000.0 for s in run.shed])
        return PolicySummary(
            run.policy,
            0,
            math.nan,
            goodput=0.0 if run.shed else None,
            preemptions=run.preemptions,
            overflow=run.overflow,
            rejected=run.rejected,
            flow_control=run.flow_control,
            flow_control_blind=run.flow_control_blind,
            # Everything that arrived was refused: every class it had met nothing.
            goodput_by_class={n: 0.0 for n in sorted(shed_by_class, key=_class_order)} or None,
            requests_by_class=dict(sorted(shed_by_class.items(), key=lambda i: _class_order(i[0])))
            or None,
            shed=len(run.shed),
            shed_by_class=shed_by_class or None,
            queued=run.queued,
            steered=run.steered,
            gateway_wait_p50_ms=_percentile(shed_waits, 50) if shed_waits.size else None,
            gateway_wait_p95_ms=_percentile(shed_waits, 95) if shed_waits.size else None,
            gateway_wait_max_ms=float(shed_waits.max()) if shed_waits.size else None,
        )
    ttft = np.array([(o.first_token_s - o.arrival_s) * 1000.0 for o in outcomes])
    tpot_all = np.array([o.tpot_ms for o in outcomes])
    tpot = tpot_all[~np.isnan(tpot_all)]
    queue = np.array([(o.scheduled_s - o.arrival_s) * 1000.0 for o in outcomes])
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    cached_tokens = sum(o.cached_tokens for o in outcomes)
    output_tokens = sum(o.output_tokens for o in outcomes)
    # A single-token answer has no TPOT: it meets that SLO by definition.
    meets = (ttft <= slo_ttft_ms) & (np.isnan(tpot_all) | (tpot_all <= slo_tpot_ms))
    # Refused requests are misses: goodput is over every request that arrived.
    judged = len(outcomes) + len(run.shed)
    served_by_class: dict[str, list[bool]] = {}
    for outcome, met in zip(outcomes, meets, strict=True):
        served_by_class.setdefault(outcome.request_class.value, []).append(bool(met))
    goodput_by_class = {
        name: sum(served_by_class.get(name, []))
        / (len(served_by_class.get(name, [])) + shed_by_class.get(name, 0))
        for name in sorted(set(served_by_class) | set(shed_by_class), key=_class_order)
    }
    waits = np.array(
        [o.gateway_wait_s * 1000.0 for o in outcomes] + [s.waited_s * 1000.0 for s in run.shed]
    )
    start = min(o.arrival_s for o in outcomes)
    makespan_s = max(o.finish_s for o in outcomes) - start
    fleet_usd = run.replicas * run.price_per_hour * makespan_s / 3600.0
    routed = run.routed_per_replica
    mean_routed = sum(routed) / len(routed)
    return PolicySummary(
        policy=run.policy,
        requests=len(outcomes),
        prefix_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else math.nan,
        ttft_p50_ms=_percentile(ttft, 50),
        ttft_p95_ms=_percentile(ttft, 95),
        ttft_p99_ms=_percentile(ttft, 99),
        tpot_p50_ms=_percentile(tpot, 50),
        tpot_p95_ms=_percentile(tpot, 95),
        queue_p95_ms=_percentile(queue, 95),
        goodput=float(meets.sum()) / judged,
        output_tok_s=output_tokens / makespan_s if makespan_s > 0 else math.nan,
        cost_per_1m_usd=fleet_usd / output_tokens * 1e6 if output_tokens else math.nan,
        load_imbalance=max(routed) / mean_routed if mean_routed else math.nan,
        preemptions=run.preemptions,
        overflow=run.overflow,
        rejected=run.rejected,
        flow_control=run.flow_control,
        flow_control_blind=run.flow_control_blind,
        goodput_by_class=goodput_by_class,
        requests_by_class={
            name: len(served_by_class.get(name, [])) + shed_by_class.get(name, 0)
            for name in goodput_by_class
        },
        shed=len(run.shed),
        shed_by_class=shed_by_class,
        queued=run.queued,
        steered=run.steered,
        gateway_wait_p50_ms=_percentile(waits, 50),
        gateway_wait_p95_ms=_percentile(waits, 95),
        gateway_wait_max_ms=float(waits.max()) if waits.size else math.nan,
    )


_CLASS_ORDER = {c.value: c.rank for c in RequestClass}


def _class_order(name: str) -> int:
    return _CLASS_ORDER.get(name, len(_CLASS_ORDER))
