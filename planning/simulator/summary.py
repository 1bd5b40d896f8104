"""Per-policy figures from raw outcomes: hit rate, latency percentiles, goodput, cost, balance."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from planning.simulator.loop import PolicyRun, RequestOutcome

__all__ = ["JSON_FIELDS", "PolicySummary", "summarize"]

#: The ``--json`` field names, in order (one object per policy).
JSON_FIELDS = (
    "policy",
    "requests",
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
)


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

    def as_json(self) -> dict[str, object]:
        """The row as a JSON object with exactly ``JSON_FIELDS``; NaN becomes null."""
        row = asdict(self)
        return {
            name: None if isinstance(row[name], float) and math.isnan(row[name]) else row[name]
            for name in JSON_FIELDS
        }


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _tpot_ms(outcome: RequestOutcome) -> float:
    if outcome.output_tokens < 2:
        return math.nan
    return (outcome.finish_s - outcome.first_token_s) * 1000.0 / (outcome.output_tokens - 1)


def summarize(run: PolicyRun, slo_ttft_ms: float, slo_tpot_ms: float) -> PolicySummary:
    """The report row of one policy run."""
    outcomes: Sequence[RequestOutcome] = run.outcomes
    if not outcomes:
        return PolicySummary(run.policy, 0, math.nan, preemptions=run.preemptions)
    ttft = np.array([(o.first_token_s - o.arrival_s) * 1000.0 for o in outcomes])
    tpot_all = np.array([_tpot_ms(o) for o in outcomes])
    tpot = tpot_all[~np.isnan(tpot_all)]
    queue = np.array([(o.scheduled_s - o.arrival_s) * 1000.0 for o in outcomes])
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    cached_tokens = sum(o.cached_tokens for o in outcomes)
    output_tokens = sum(o.output_tokens for o in outcomes)
    # A single-token answer has no TPOT: it meets that SLO by definition.
    meets = (ttft <= slo_ttft_ms) & (np.isnan(tpot_all) | (tpot_all <= slo_tpot_ms))
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
        goodput=float(meets.mean()),
        output_tok_s=output_tokens / makespan_s if makespan_s > 0 else math.nan,
        cost_per_1m_usd=fleet_usd / output_tokens * 1e6 if output_tokens else math.nan,
        load_imbalance=max(routed) / mean_routed if mean_routed else math.nan,
        preemptions=run.preemptions,
    )
