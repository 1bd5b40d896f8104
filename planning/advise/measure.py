"""Turn scrapes taken over a watch window into one pool's ``Measurements``.

Gauges: ``kv_usage`` is the fullest replica's mean over the samples (the fullest one preempts
first); the queue is the pool's total ``waiting`` per replica, and its growth the slope between the
first and last sample. Preemptions: the counter's increase per minute; the ``running`` level at
which it moved is the preemption onset ``--max-num-seqs`` is set below. A lifetime counter still at
0 means 0/min even from one scrape. Lengths: the gateway's per-pool histograms when read (it sees
every request), else vLLM's own prompt and generation histograms (their p99s summed: an upper
bound on prompt + output).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from planning.advise.engine_metrics import ENGINE_LENGTHS, ENGINE_TIMERS, EngineReading, Histogram
from planning.advise.model import Measurements, Percentiles
from planning.triage.histogram import histogram_quantile

#: Every request has one first token: the TTFT histogram's count is the engine's request count.
TTFT = ENGINE_TIMERS["ttft"]


@dataclass(frozen=True)
class Sample:
    """Every replica of one pool read once, at ``at_s`` (monotonic seconds)."""

    at_s: float
    readings: Sequence[EngineReading]


@dataclass(frozen=True)
class Lengths:
    """Per-request length histograms of one pool (prompt, output, prompt + output)."""

    prompt: Histogram
    output: Histogram
    context: Histogram | None = None


@dataclass(frozen=True)
class AdapterActivity:
    """Adapter figures from the gateway over the window (None where it was not read)."""

    requested: frozenset[str] = frozenset()
    loads_per_min: float | None = None
    unloads_per_min: float | None = None


def percentile(hist: Histogram | None, q: float) -> float | None:
    """A quantile of a histogram, or None when it is empty."""
    if hist is None or not hist.buckets:
        return None
    return histogram_quantile(q, hist.buckets.items())


def longest(hist: Histogram | None) -> float | None:
    """The upper bound of the top non-empty bucket: no request seen was longer."""
    if hist is None or not hist.buckets:
        return None
    ordered = sorted(hist.buckets.items())
    total = ordered[-1][1]
    if total <= 0:
        return None
    finite = [(le, n) for le, n in ordered if le != float("inf")]
    for le, count in finite:
        if count >= total:
            return le
    return None  # some request was longer than the top bucket


def mean(hist: Histogram | None) -> float | None:
    """The mean of a histogram from its sum and count."""
    if hist is None or hist.count <= 0:
        return None
    return hist.total / hist.count


def _pool_histogram(readings: Sequence[EngineReading], family: str) -> Histogram | None:
    found = [r.histograms[family] for r in readings if family in r.histograms]
    if not found:
        return None
    total = Histogram()
    for hist in found:
        total.add(hist)
    return total


def engine_lengths(readings: Sequence[EngineReading]) -> Lengths | None:
    """vLLM's own prompt/generation histograms summed over a pool's replicas."""
    prompt = _pool_histogram(readings, ENGINE_LENGTHS["prompt"])
    output = _pool_histogram(readings, ENGINE_LENGTHS["output"])
    if prompt is None or output is None:
        return None
    return Lengths(prompt, output)


def _ms(hist: Histogram | None, q: float) -> float | None:
    value = percentile(hist, q)
    return None if value is None else value * 1000.0


def timers(readings: Sequence[EngineReading]) -> dict[str, Percentiles]:
    """The four timers at p50/p95/p99 from the engines' histograms (lifetime)."""
    out = {}
    for name, family in ENGINE_TIMERS.items():
        hist = _pool_histogram(readings, family)
        if hist is not None and hist.buckets:
            out[name] = Percentiles(_ms(hist, 0.5), _ms(hist, 0.95), _ms(hist, 0.99))
    return out


def measurements(
    samples: Sequence[Sample],
    lengths: Lengths | None,
    adapters: AdapterActivity | None = None,
) -> Measurements:
    """One pool's measurements from its samples (oldest first), lengths and adapter activity."""
    first, last = samples[0], samples[-1]
    window = last.at_s - first.at_s
    replicas = max(1, len(last.readings))
    kv_by_replica: dict[int, list[float]] = {}
    for sample in samples:
        for i, r in enumerate(sample.readings):
            if r.kv_usage is not None:
                kv_by_replica.setdefault(i, []).append(r.kv_usage)
    kv = max((sum(v) / len(v) for v in kv_by_replica.values()), default=None)
    waiting = [sum(r.waiting for r in s.readings) / replicas for s in samples]
    growth = (waiting[-1] - waiting[0]) / window * 60 if window > 0 else None
    preempt_first = sum(r.preemptions_total for r in first.readings)
    preempt_last = sum(r.preemptions_total for r in last.readings)
    if window > 0:
        preemptions = max(0.0, preempt_last - preempt_first) / window * 60
    else:
        preemptions = 0.0 if preempt_last == 0 else None
    onset = _preemption_onset(samples)
    running_peak = max((r.running for s in samples for r in s.readings), default=None)
    queries = sum(r.prefix_queries for r in last.readings)
    hits = sum(r.prefix_hits for r in last.readings)
    d_queries = queries - sum(r.prefix_queries for r in first.readings)
    d_hits = hits - sum(r.prefix_hits for r in first.readings)
    hit_rate = d_hits / d_queries if d_queries > 0 else (hits / queries if queries > 0 else None)
    served = [
        sum(r.histograms[TTFT].count for r in s.readings if TTFT in r.histograms)
        for s in (first, last)
    ]
    rate = (served[1] - served[0]) / window if window > 0 else None
    seen_adapters = frozenset(a for s in samples for r in s.readings for a in r.adapters)
    working = seen_adapters | (adapters.requested if adapters else frozenset())
    lora_on = any(r.max_lora is not None for r in last.readings)
    context = (lengths.context if lengths else None) or None
    ctx_p99 = percentile(context, 0.99)
    ctx_max = longest(context)
    if lengths is not None and context is None:
        # Only separate histograms: the sum of the p99s bounds the p99 of the sum from above.
        p, o = percentile(lengths.prompt, 0.99), percentile(lengths.output, 0.99)
        ctx_p99 = p + o if p is not None and o is not None else None
        lp, lo = longest(lengths.prompt), longest(lengths.output)
        ctx_max = lp + lo if lp is not None and lo is not None else None
    return Measurements(
        requests=int(lengths.prompt.count) if lengths and lengths.prompt.count else None,
        request_rate_per_s=rate,
        context_p99=ctx_p99,
        context_max=ctx_max,
        prompt_p99=percentile(lengths.prompt, 0.99) if lengths else None,
        output_p99=percentile(lengths.output, 0.99) if lengths else None,
        prompt_mean=mean(lengths.prompt) if lengths else None,
        output_mean=mean(lengths.output) if lengths else None,
        kv_usage=min(1.0, kv) if kv is not None else None,
        waiting_mean=sum(waiting) / len(waiting),
        waiting_growth_per_min=growth,
        preemptions_per_min=preemptions,
        running_at_preemption=onset,
        running_peak=running_peak,
        adapter_working_set=len(working) if lora_on or working else None,
        adapter_loads_per_min=adapters.loads_per_min if adapters else None,
        adapter_unloads_per_min=adapters.unloads_per_min if adapters else None,
        prefix_hit_rate=hit_rate,
        timers=timers(last.readings),
        window_s=window,
    )


def _preemption_onset(samples: Sequence[Sample]) -> int | None:
    """Lowest ``running`` on a replica whose preemption counter moved between two samples."""
    levels = []
    for before, after in itertools.pairwise(samples):
        for b, a in zip(before.readings, after.readings, strict=False):
            if a.preemptions_total > b.preemptions_total:
                levels.append(max(a.running, b.running))
    return min(levels) if levels else None
