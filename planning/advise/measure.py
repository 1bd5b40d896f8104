"""Turn scrapes taken over a watch window into one pool's ``Measurements``.

Gauges: ``kv_usage`` is the fullest replica's mean over the samples (the fullest one preempts
first); the queue is the pool's total ``waiting`` per replica, and its growth the slope between the
first and last sample. Preemptions: the counter's increase per minute; the ``running`` level at
which it moved is the preemption onset ``--max-num-seqs`` is set below. A lifetime counter still at
0 means 0/min even from one scrape. Lengths: the gateway's per-pool histograms when read (it sees
every request), else vLLM's own prompt and generation histograms (their p99s summed: an upper
bound on prompt + output). Only the gateway sees the output budget requests ask for
(``max_tokens``), so ``requested_context_max`` is known only when it is read.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from planning.advise.engine_metrics import ENGINE_LENGTHS, ENGINE_TIMERS, EngineReading, Histogram
from planning.advise.model import Measurements, Percentiles
from planning.triage.histogram import histogram_quantile, in_first_bucket

#: Every request has one first token: the TTFT histogram's count is the engine's request count.
TTFT = ENGINE_TIMERS["ttft"]


@dataclass(frozen=True)
class Sample:
    """Every replica of one pool read once, at ``at_s`` (monotonic seconds)."""

    at_s: float
    readings: Sequence[EngineReading]


@dataclass(frozen=True)
class Lengths:
    """Per-request length histograms of one pool (prompt, output, prompt + output, and prompt +
    the output budget requested, where the gateway records it)."""

    prompt: Histogram
    output: Histogram
    context: Histogram | None = None
    budget: Histogram | None = None


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


def engine_lengths(
    readings: Sequence[EngineReading], earlier: Sequence[EngineReading] | None = None
) -> Lengths | None:
    """vLLM's own prompt/generation histograms summed over a pool's replicas.

    With ``earlier`` (the same replicas read before), only what they served since.
    """
    prompt = _pool_histogram(readings, ENGINE_LENGTHS["prompt"])
    output = _pool_histogram(readings, ENGINE_LENGTHS["output"])
    if prompt is None or output is None:
        return None
    if earlier is not None:
        prompt = prompt.since(_pool_histogram(earlier, ENGINE_LENGTHS["prompt"]) or Histogram())
        output = output.since(_pool_histogram(earlier, ENGINE_LENGTHS["output"]) or Histogram())
    return Lengths(prompt, output)


def _ms(hist: Histogram | None, q: float) -> float | None:
    value = percentile(hist, q)
    return None if value is None else value * 1000.0


def timers(readings: Sequence[EngineReading]) -> dict[str, Percentiles]:
    """The four timers at p50/p95/p99 from the engines' histograms (lifetime); a quantile in
    a histogram's first bucket is reported as that bucket's bound, marked ``at_most``."""
    out = {}
    for name, family in ENGINE_TIMERS.items():
        hist = _pool_histogram(readings, family)
        if hist is None or not hist.buckets:
            continue
        buckets = sorted(hist.buckets.items())
        cells: dict[str, float | None] = {}
        at_most = []
        for field, q in (("p50_ms", 0.5), ("p95_ms", 0.95), ("p99_ms", 0.99)):
            if in_first_bucket(q, buckets):
                cells[field] = buckets[0][0] * 1000.0
                at_most.append(field)
            else:
                cells[field] = _ms(hist, q)
        out[name] = Percentiles(**cells, at_most=tuple(at_most))
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
    ctx_p99, ctx_max = context_bounds(lengths)
    return Measurements(
        requests=int(lengths.prompt.count) if lengths and lengths.prompt.count else None,
        request_rate_per_s=rate,
        context_p99=ctx_p99,
        context_max=ctx_max,
        requested_context_max=longest(lengths.budget) if lengths else None,
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


def context_bounds(lengths: Lengths | None) -> tuple[float | None, float | None]:
    """(p99, longest) of prompt + output, as tight as the histograms allow.

    Length buckets double, so the prompt + output histogram alone can overstate its p99 by up to
    2x. The separate histograms bound it too: at most 1% of requests have a prompt over its p99,
    so p99(prompt + output) <= p99(prompt) + longest output (and symmetrically); the longest
    request is at most the longest prompt plus the longest output. The smallest bound wins.
    """
    if lengths is None:
        return None, None
    p99s = [percentile(lengths.context, 0.99)]
    tops = [longest(lengths.context)]
    prompt_p99, output_p99 = percentile(lengths.prompt, 0.99), percentile(lengths.output, 0.99)
    prompt_top, output_top = longest(lengths.prompt), longest(lengths.output)
    if prompt_p99 is not None and output_top is not None:
        p99s.append(prompt_p99 + output_top)
    if prompt_top is not None and output_p99 is not None:
        p99s.append(prompt_top + output_p99)
    if prompt_top is not None and output_top is not None:
        tops.append(prompt_top + output_top)
    known_p99 = [x for x in p99s if x is not None]
    known_top = [x for x in tops if x is not None]
    top = min(known_top, default=None)
    p99 = min(known_p99, default=None)
    return (min(p99, top) if p99 is not None and top is not None else p99), top


def _preemption_onset(samples: Sequence[Sample]) -> int | None:
    """Lowest ``running`` on a replica whose preemption counter moved between two samples."""
    levels = []
    for before, after in itertools.pairwise(samples):
        for b, a in zip(before.readings, after.readings, strict=False):
            if a.preemptions_total > b.preemptions_total:
                levels.append(max(a.running, b.running))
    return min(levels) if levels else None
