"""Benchmark: routing quality of every built-in policy across load, on each generated workload.

For each workload shape of ``bench/workloads`` (RAG chatbot, cache-buster RAG, multi-turn chat,
few-shot agents, B2B LoRA fine-tunes) it generates a trace at the workload's *saturation rate*
and replays it through every built-in policy at 0.5x, 1x, 2x, 3x and 4x that rate, on a simulated
fleet of 8 replicas (``planning/simulator``: the real ``routing/`` code, ``replica/sim`` engine
models, virtual time). One seed per load level; three at 1x and 3x, to show the spread.

At each load level it checks what the gateway's default policy (``DEFAULT_PROFILE`` of
``routing/policies/registry.py``, whatever its name) must show against the other policies:

- the best goodput of all policies (ties within 0.5 points allowed);
- a p95 TTFT no worse than the best other policy's;
- a hit rate of at least 0.9 x the pooled ceiling;
- from 2x up, a goodput at least 3 points above the best other policy's.

It prints PASS or FAIL for each check at each level and rewrites
``docs/benchmarks/routing-quality.md`` (the checks, the sweep as tables, the command) with PNGs
under ``docs/benchmarks/routing-quality/``. Run from the repository root (the full default sweep:
45 replays of every built-in policy, 30-45 CPU-seconds each, so about 15 minutes with the default
``--jobs 2`` on 2 otherwise idle CPUs, and several times that on a busy machine)::

    .venv/bin/python -m bench.routing_quality

Smaller runs: ``--workloads``, ``--scales``, ``--requests``, ``--policies``, ``--seeds``; write them
elsewhere with ``--out /tmp/rq.md``. ``--trace FILE`` sweeps a Mooncake-format trace instead (scales
relative to the trace's own rate, or to its measured saturation rate with ``--find-saturation``).

``--speed-check`` instead times the simulator on a 10,000-request trace of ~12k-token prompts
over 8 replicas (the figure quoted in ``docs/simulate.md``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

from bench._bench_common import write_page
from bench.policy_variants import PolicyVariant, parse_variant
from bench.workloads import generate
from bench.workloads.blocks import BlockIdAllocator, Segment
from fleetgate.commands.simulate import rate_scales
from planning.simulator import (
    PolicySummary,
    SimulationConfig,
    SimulationReport,
    prepare_requests,
    simulate,
)
from planning.simulator.api import SweepPoint, mean_rate
from planning.simulator.config import parse_profile_mix
from planning.simulator.report import write_load_plots
from planning.simulator.summary import Spread, default_policy
from routing.policies.registry import BUILTIN_PROFILES
from traces.format import DEFAULT_BLOCK_SIZE, TraceFormatError, TraceRecord, read_trace
from traces.notes import trace_notes
from traces.spread import spread_arrivals

DEFAULT_SCALES = (0.5, 1.0, 2.0, 3.0, 4.0)
#: Load levels replayed with several seeds, to show how much one seed's figures can move.
SPREAD_SCALES = (1.0, 3.0)
DEFAULT_SEEDS = 3
#: Requests per trace. The saturation rates below were measured on 2,000-request traces, and p95
#: queue time near saturation grows with trace length, so 1x keeps its meaning only at this
#: length. Past saturation a trace is an overload burst of 2,000 / (rate x scale) seconds (rag at
#: 4x: 3.6 s, b2b-lora at 4x: 20 s), long enough for queues to pass the TTFT SLO many times over.
DEFAULT_REQUESTS = 2000
DEFAULT_PAGE = "docs/benchmarks/routing-quality.md"

HIT_RATE_TARGET = 0.9
#: Goodput within this of the best other policy's counts as a tie for "best goodput".
GOODPUT_TIE = 0.005
#: From this load up, the default policy must beat the best other goodput by GOODPUT_MARGIN.
MARGIN_FROM_SCALE = 2.0
GOODPUT_MARGIN = 0.03

#: The saturation rate's definition: the arrival rate at which this policy's p95 queue time
#: (arrival to first scheduling) passes this many ms on the benchmark's fleet.
SATURATION_POLICY = "least-loaded"
SATURATION_QUEUE_P95_MS = 1000.0


@dataclass(frozen=True)
class Workload:
    """One generated benchmark workload: a generator shape and its saturation rate."""

    shape: str
    #: Arrival rate (req/s) at which least-loaded's p95 queue time passes 1 s on 8 replicas
    #: (2,000-request trace, seed 0). The sweep's load levels are multiples of it.
    saturation_rate: float
    what: str


#: Saturation rates measured on 2026-12-04 with ``--find-saturation`` (the middle of a 4.4%-wide
#: bracket), after the engine model began committing prefix blocks when it schedules them. The
#: table before (2026-12-01: rag 143, rag-cache-buster 34.1, multi-turn 144, agent 66.4, b2b-lora
#: 21.5) had moved by 2-7%: at 66.4 req/s least-loaded's p95 queue on agent was 655 ms. The first
#: (2026-11-29: rag 140, rag-cache-buster 38, multi-turn 135, agent 65, b2b-lora 25) had drifted
#: further: at 38 and 25 req/s least-loaded's p95 queue was 6.0 s and 2.4 s.
WORKLOADS: tuple[Workload, ...] = (
    Workload("rag", 139.9, "3,000-token shared system prompt + Zipf RAG chunks"),
    Workload("rag-cache-buster", 33.37, "the same, with a timestamp on top: nothing shared"),
    Workload("multi-turn", 147.2, "chat sessions whose history grows turn by turn"),
    Workload("agent", 70.86, "few-shot agent prompts + growing tool-call transcripts"),
    Workload("b2b-lora", 21.97, "40 LoRA fine-tunes (Zipf), 4 GPU LoRA slots/replica"),
)


# --------------------------------------------------------------------------- what is swept


@dataclass(frozen=True)
class Subject:
    """What one sweep replays: a trace per seed, and the rate its load levels multiply."""

    name: str
    what: str
    #: Seed -> the trace replayed with that seed.
    traces: Mapping[int, tuple[TraceRecord, ...]]
    #: Requests/s the traces arrive at as recorded (generated: the rate asked of the generator).
    trace_rate: float
    #: Requests/s at load 1x.
    reference_rate: float
    #: What load 1x is, in words (for the page).
    reference: str

    def factor(self, scale: float) -> float:
        """The rate scale to apply to the recorded trace for load ``scale`` x reference."""
        return scale * self.reference_rate / self.trace_rate


def generated_subject(workload: Workload, requests: int, seeds: Sequence[int]) -> Subject:
    """A workload's traces, one per seed, generated at its saturation rate."""
    traces = {
        seed: tuple(generate(workload.shape, requests, workload.saturation_rate, seed=seed))
        for seed in seeds
    }
    rate = workload.saturation_rate
    return Subject(
        workload.shape, workload.what, traces, rate, rate, "the saturation rate (Workload table)"
    )


def trace_subject(
    path: str,
    block_size: int,
    limit: int | None,
    seeds: Sequence[int],
    arrival_spread_ms: int = 0,
) -> Subject:
    """A trace file's first ``limit`` requests; load 1x is its own rate until measured.

    The file is one fixed trace: seeds vary routing's random choices and, with
    ``arrival_spread_ms``, where each arrival falls within that many ms after its timestamp
    (``traces.spread``), not the traffic itself.
    """
    records = tuple(read_trace(path, block_size, limit))
    for note in trace_notes(path, records, arrival_spread_ms):
        print(note, file=sys.stderr)
    if len(records) < 2:
        raise ValueError(f"{path}: a sweep needs at least 2 requests (got {len(records)})")
    rate = mean_rate(prepare_requests(records))
    if not math.isfinite(rate):
        raise ValueError(f"{path}: every request arrives at the same time; no rate to scale")
    return Subject(
        Path(path).stem,
        f"trace {path}",
        {seed: spread_arrivals(records, arrival_spread_ms, seed) for seed in seeds},
        rate,
        rate,
        "the trace's own rate",
    )


def seeds_at(scale: float, spread_scales: Sequence[float], seeds: int) -> tuple[int, ...]:
    """Seeds replayed at ``scale``: ``seeds`` of them at the spread scales, else seed 0."""
    return tuple(range(seeds)) if scale in spread_scales else (0,)


# --------------------------------------------------------------------------- saturation search


@dataclass(frozen=True)
class Probe:
    """One replay of the saturation search."""

    rate: float
    queue_p95_ms: float


@dataclass(frozen=True)
class SaturationSearch:
    """Where ``SATURATION_POLICY``'s p95 queue time passes ``SATURATION_QUEUE_P95_MS``."""

    rate: float
    probes: tuple[Probe, ...]


def find_saturation(
    records: Sequence[TraceRecord],
    trace_rate: float,
    config: SimulationConfig,
    *,
    refinements: int = 4,
    max_doublings: int = 8,
) -> SaturationSearch:
    """Bracket the saturation rate by doubling or halving, then bisect it (geometrically).

    Each probe replays ``records`` through ``SATURATION_POLICY`` alone. The bracket starts a
    factor of 2 wide; four refinements narrow it to 2^(1/16) ≈ 4.4%, for 6-12 replays in all.
    The rate returned is the bracket's geometric middle.
    """
    probes: list[Probe] = []

    def saturated(factor: float) -> bool:
        requests = prepare_requests(records, rate_scale=factor)
        row = simulate(requests, [SATURATION_POLICY], config).summaries[0]
        queue = _num(row.queue_p95_ms, math.inf)
        probes.append(Probe(factor * trace_rate, queue))
        return queue > SATURATION_QUEUE_P95_MS

    try:
        low, high = _bracket(saturated, max_doublings)
    except ValueError as exc:
        group = largest_arrival_group(records)
        if probes[-1].queue_p95_ms > SATURATION_QUEUE_P95_MS and group > 1:
            # Saturated at every rate: scaling the rate cannot spread requests that share a
            # timestamp, and on a small fleet such a group alone queues past the threshold.
            raise ValueError(
                f"{exc}, saturated even at the lowest: the trace's requests arrive in groups "
                f"at identical timestamps (up to {group} at once; scaling the rate does not "
                "spread them), and on this fleet a group alone queues that long. Spread "
                "them over the trace's timestamp resolution (--arrival-spread-ms, e.g. 3000 "
                "for 3-second buckets), drop --find-saturation to make load 1x the trace's "
                "own rate, or add replicas (--replicas)"
            ) from None
        raise
    for _ in range(refinements):
        middle = math.sqrt(low * high)
        if saturated(middle):
            high = middle
        else:
            low = middle
    return SaturationSearch(math.sqrt(low * high) * trace_rate, tuple(probes))


def largest_arrival_group(records: Sequence[TraceRecord]) -> int:
    """The most requests of ``records`` that share one timestamp (0 for none)."""
    counts = Counter(record.timestamp for record in records)
    return max(counts.values(), default=0)


def _bracket(saturated: Callable[[float], bool], max_doublings: int) -> tuple[float, float]:
    """Factors (low, high) of the recorded rate with ``high`` saturated and ``low`` not."""
    step = 0.5 if saturated(1.0) else 2.0
    factor = 1.0
    for _ in range(max_doublings):
        factor *= step
        if saturated(factor) != (step == 0.5):
            return (factor, factor / step) if step == 0.5 else (factor / step, factor)
    raise ValueError(
        f"{SATURATION_POLICY}'s p95 queue time never crossed {SATURATION_QUEUE_P95_MS:g} ms "
        f"between {2.0**-max_doublings:g}x and {2.0**max_doublings:g}x the trace's rate"
    )


# --------------------------------------------------------------------------- running points


@dataclass(frozen=True)
class PointTask:
    """One simulation of the sweep: every policy on one subject at one load with one seed."""

    subject: str
    scale: float
    seed: int
    factor: float
    records: tuple[TraceRecord, ...]
    policies: tuple[str, ...]
    config: SimulationConfig
    #: Built-in policies with changed parameters, replayed after ``policies`` (``--variant``).
    variants: tuple[PolicyVariant, ...] = ()


@dataclass(frozen=True)
class PointResult:
    """What one task measured; the raw per-request outcomes stay in the worker."""

    subject: str
    point: SweepPoint
    #: Requests the engines refused, per policy (only policies that refused any).
    rejected: Mapping[str, int]
    wall_s: float
    #: CPU seconds of the worker: what the point costs on a machine with a core to itself.
    cpu_s: float


def run_point(task: PointTask) -> PointResult:
    """Replay one task (in a worker process when ``--jobs`` > 1)."""
    started, cpu = time.perf_counter(), time.process_time()
    requests = prepare_requests(task.records, rate_scale=task.factor)
    report = simulate(
        requests,
        (*task.policies, *(v.name for v in task.variants)),
        replace(task.config, seed=task.seed),
        profile_factories={v.name: v.build for v in task.variants},
    )
    # Summaries only: shipping every request's outcome back from a worker costs more than it says.
    compact = SimulationReport(report.summaries, report.ceilings, wall_s=report.wall_s)
    rejected = {name: run.rejected for name, run in report.runs.items() if run.rejected}
    point = SweepPoint(task.scale, task.seed, len(requests), mean_rate(requests), compact)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    return PointResult(task.subject, point, rejected, wall_s, cpu_s)


def run_points(
    tasks: Sequence[PointTask], jobs: int, on_result: Callable[[PointResult], None]
) -> list[PointResult]:
    """Run every task, ``jobs`` at a time; results come back in task order."""
    if jobs <= 1:
        results = []
        for task in tasks:
            results.append(run_point(task))
            on_result(results[-1])
        return results
    by_task: dict[int, PointResult] = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_point, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            by_task[futures[future]] = future.result()
            on_result(by_task[futures[future]])
    return [by_task[i] for i in range(len(tasks))]


# --------------------------------------------------------------------------- load levels


@dataclass(frozen=True)
class PolicyAtLoad:
    """One policy's figures at one load level, over that level's seeds."""

    policy: str
    goodput: Spread
    ttft_p95_ms: Spread
    hit_rate: Spread
    queue_p95_ms: Spread


@dataclass(frozen=True)
class LoadLevel:
    """One subject at one load: every policy, over the seeds replayed there."""

    subject: str
    scale: float
    #: Mean arrival rate over the seeds, requests/s.
    rate: float
    seeds: tuple[int, ...]
    policies: tuple[PolicyAtLoad, ...]
    pooled: Spread

    def get(self, policy: str) -> PolicyAtLoad | None:
        """The figures of ``policy``, or None when it was not replayed."""
        return next((p for p in self.policies if p.policy == policy), None)


def load_level(subject: str, points: Sequence[SweepPoint]) -> LoadLevel:
    """Aggregate the points of one subject at one scale (one per seed)."""
    names = [s.policy for s in points[0].report.summaries]

    def spread(policy: str, read: Callable[[PolicySummary], float | None]) -> Spread:
        return Spread.of(
            [read(s) for p in points for s in p.report.summaries if s.policy == policy]
        )

    policies = tuple(
        PolicyAtLoad(
            name,
            spread(name, lambda s: s.goodput),
            spread(name, lambda s: s.ttft_p95_ms),
            spread(name, lambda s: s.prefix_hit_rate),
            spread(name, lambda s: s.queue_p95_ms),
        )
        for name in names
    )
    return LoadLevel(
        subject,
        points[0].rate_scale,
        sum(p.rate for p in points) / len(points),
        tuple(p.seed for p in points),
        policies,
        Spread.of([p.report.ceilings.pooled for p in points]),
    )


def load_levels(results: Sequence[PointResult]) -> list[LoadLevel]:
    """One level per (subject, scale), in the order the results first name them."""
    groups: dict[tuple[str, float], list[SweepPoint]] = {}
    for result in results:
        groups.setdefault((result.subject, result.point.rate_scale), []).append(result.point)
    return [load_level(subject, points) for (subject, _), points in groups.items()]


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """One must-show check at one load level."""

    name: str
    #: None: the check does not apply at this load (the margin below MARGIN_FROM_SCALE).
    passed: bool | None
    detail: str

    @property
    def verdict(self) -> str:
        return "–" if self.passed is None else "PASS" if self.passed else "FAIL"


@dataclass(frozen=True)
class Verdict:
    """The default policy's checks at one load level."""

    subject: str
    scale: float
    default: str
    checks: tuple[Check, ...]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]


CHECK_NAMES = ("best goodput", "p95 TTFT", "hit rate", "goodput margin")


def evaluate(level: LoadLevel, default: str) -> Verdict | None:
    """The four checks for ``default`` at ``level`` (on means over seeds).

    None when ``default`` was not replayed or nothing else was (no baseline to compare with).
    """
    mine = level.get(default)
    # Built-ins only: a --variant is a candidate under study, not a baseline.
    others = [p for p in level.policies if p.policy != default and p.policy in BUILTIN_PROFILES]
    if mine is None or not others:
        return None
    best_good = max(others, key=lambda p: _num(p.goodput.mean, -math.inf))
    best_ttft = min(others, key=lambda p: _num(p.ttft_p95_ms.mean, math.inf))
    goodput = _num(mine.goodput.mean, -math.inf)
    other_goodput = _num(best_good.goodput.mean, -math.inf)
    ttft = _num(mine.ttft_p95_ms.mean, math.inf)
    other_ttft = _num(best_ttft.ttft_p95_ms.mean, math.inf)
    hit = _num(mine.hit_rate.mean, -math.inf)
    pooled = _num(level.pooled.mean, math.inf)
    margin = goodput - other_goodput
    goodput_detail = f"{_pct(goodput)} vs {_pct(other_goodput)} ({best_good.policy})"
    checks = (
        Check("best goodput", margin >= -GOODPUT_TIE, goodput_detail),
        Check(
            "p95 TTFT",
            ttft <= other_ttft,
            f"{_ms(ttft, other_ttft)} ms ({best_ttft.policy})",
        ),
        Check(
            "hit rate",
            hit >= HIT_RATE_TARGET * pooled,
            f"{_pct(hit)} / pooled {_pct(pooled)} = {_ratio(hit, pooled)}",
        ),
        Check(
            "goodput margin",
            margin >= GOODPUT_MARGIN if level.scale >= MARGIN_FROM_SCALE else None,
            f"{margin * 100:+.1f} points vs {best_good.policy}",
        ),
    )
    return Verdict(level.subject, level.scale, default, checks)


def _num(value: float | None, default: float) -> float:
    return default if value is None or math.isnan(value) else value


def _ms(mine: float, other: float) -> str:
    """``mine vs other``, with a decimal when whole milliseconds would hide the difference."""
    close = math.isfinite(mine + other) and mine != other and round(mine) == round(other)
    fmt = "{:,.1f}" if close else "{:,.0f}"

    def show(value: float) -> str:
        return fmt.format(value) if math.isfinite(value) else "–"

    return f"{show(mine)} vs {show(other)}"


def _pct(value: float) -> str:
    return f"{value:.1%}" if math.isfinite(value) else "–"


def _ratio(value: float, ceiling: float) -> str:
    # Nothing to hit (rag-cache-buster): 0 >= 0.9 x 0 holds, and the ratio has no meaning.
    return f"{value / ceiling:.0%}" if ceiling > 0 and math.isfinite(value) else "n/a"


def checks_text(verdicts: Sequence[Verdict]) -> str:
    """The verdicts as plain text, one line per load level (stdout)."""
    lines = []
    for v in verdicts:
        cells = [f"{c.name} {c.verdict}: {c.detail}" for c in v.checks if c.passed is not None]
        lines.append(f"{v.subject} {v.scale:g}x: " + "; ".join(cells))
    failed = sum(len(v.failed) for v in verdicts)
    applied = sum(1 for v in verdicts for c in v.checks if c.passed is not None)
    lines.append(f"checks: {applied - failed} of {applied} passed, {failed} failed")
    return "\n".join(lines)


# --------------------------------------------------------------------------- markdown


@dataclass(frozen=True)
class PageContext:
    """What the page says about how it was made."""

    command: str
    wall_s: float
    #: CPU seconds summed over every point's worker.
    cpu_s: float
    jobs: int
    requests: int
    config: SimulationConfig
    plot_dir: str
    scales: tuple[float, ...]
    spread_scales: tuple[float, ...]
    seeds: int
    default: str


def _fmt(value: float | int | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def _spread_cell(spread: Spread, fmt: str, factor: float = 1.0, unit: str = "") -> str:
    """Mean, and the min–max range when several seeds were replayed: ``61.2% (59.8–62.0)``."""
    if spread.count == 0:
        return "–"
    cell = fmt.format(spread.mean * factor) + unit
    if spread.count > 1:
        cell += f" ({fmt.format(spread.low * factor)}–{fmt.format(spread.high * factor)})"
    return cell


def sweep_table(
    levels: Sequence[LoadLevel],
    read: Callable[[PolicyAtLoad], Spread],
    fmt: str,
    default: str,
    *,
    percent: bool = False,
    pooled: bool = False,
) -> str:
    """One figure as policies x load levels (the default policy in bold); shares as percent."""
    factor, unit = (100.0, "%") if percent else (1.0, "")
    header = "| policy | " + " | ".join(f"{lv.scale:g}×" for lv in levels) + " |"
    lines = [header, "|---" * (len(levels) + 1) + "|"]
    for policy in [p.policy for p in levels[0].policies]:
        name = f"**{policy}** (default)" if policy == default else policy
        cells = []
        for level in levels:
            row = level.get(policy)
            cells.append(_spread_cell(read(row), fmt, factor, unit) if row is not None else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if pooled:
        cells = [_spread_cell(lv.pooled, fmt, factor, unit) for lv in levels]
        lines.append("| *ceiling: pooled* | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks_table(verdicts: Sequence[Verdict]) -> str:
    """PASS/FAIL per check per load level, with the figures compared."""
    lines = [
        "| workload | load | " + " | ".join(CHECK_NAMES) + " |",
        "|---" * (len(CHECK_NAMES) + 2) + "|",
    ]
    for v in verdicts:
        cells = [
            "–" if c.passed is None else f"{'PASS' if c.passed else '**FAIL**'}: {c.detail}"
            for c in v.checks
        ]
        lines.append(f"| {v.subject} | {v.scale:g}× | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(report: SimulationReport, default: str) -> str:
    """One point's full results as a markdown table, ceilings last."""
    lines = [
        "| policy | hit rate | TTFT p50 | TTFT p95 | TTFT p99 | TPOT p50 | TPOT p95 | queue p95 "
        "| goodput | out tok/s | $/1M out | imbalance | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report.rows():
        name = f"**{row.policy}**" if row.policy == default else row.policy
        if row.requests is None:
            name = f"*ceiling: {row.policy}*"
        cells = [
            name,
            _fmt(row.prefix_hit_rate, "{:.1%}"),
            _fmt(row.ttft_p50_ms, "{:.0f}"),
            _fmt(row.ttft_p95_ms, "{:.0f}"),
            _fmt(row.ttft_p99_ms, "{:.0f}"),
            _fmt(row.tpot_p50_ms, "{:.1f}"),
            _fmt(row.tpot_p95_ms, "{:.1f}"),
            _fmt(row.queue_p95_ms, "{:.0f}"),
            _fmt(row.goodput, "{:.1%}"),
            _fmt(row.output_tok_s, "{:,.0f}"),
            _fmt(row.cost_per_1m_usd, "{:.3f}"),
            _fmt(row.load_imbalance, "{:.2f}"),
            _fmt(row.preemptions, "{}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _header(ctx: PageContext) -> list[str]:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    config = ctx.config
    spread = ", ".join(f"{x:g}×" for x in ctx.spread_scales if x in ctx.scales)
    seeds = "one seed (0) per load level"
    if spread and ctx.seeds > 1:
        seeds += f"; seeds 0–{ctx.seeds - 1} at {spread}"
    return [
        "# Routing quality across load",
        "",
        "Every built-in routing policy replayed at several loads on each workload by the fleet "
        "simulator (`planning/simulator`, see [simulate.md](../simulate.md)): the real "
        "`routing/` engine, policies and in-memory block index (fed by the engines' KV events "
        "and by speculative inserts after each decision), in front of simulated vLLM engines "
        "(`replica/sim`: roofline step times, continuous batching, paged prefix cache, LoRA "
        "slots), in virtual time. Same trace, fresh fleet and fresh policy state for each policy.",
        "",
        "Generated by `bench/routing_quality.py`; rerun it to refresh this page and its PNGs:",
        "",
        "```",
        ctx.command,
        "```",
        "",
        f"- Date: {now}; {ctx.wall_s / 60:.1f} min on {platform.machine()} with {ctx.jobs} "
        f"worker process(es), {ctx.cpu_s / 60:.1f} CPU-minutes in all, Python "
        f"{platform.python_version()} (a shared machine: wall times vary with the neighbours).",
        f"- Fleet: {config.replicas} x `{config.profile}`; routing sees fresh engine gauges "
        "(`--stats-interval-ms 0`) and its own in-flight counts.",
        f"- Default policy (`DEFAULT_PROFILE` of `routing/policies/registry.py`, what "
        f"`fleetgate serve` and `fleetgate up` route with): **{ctx.default}**.",
        f"- Traces: {ctx.requests:,} requests per trace; {seeds}. A seed sets routing's random "
        "choices and, for a generated workload, the trace (`python -m bench.workloads SHAPE "
        "--seed N`) or, for a recorded trace replayed with `--arrival-spread-ms`, where each "
        "arrival falls after its timestamp; figures at a multi-seed level are means, with the "
        "min–max range in brackets.",
        f"- SLOs for goodput: TTFT ≤ {config.slo_ttft_ms:g} ms and TPOT ≤ {config.slo_tpot_ms:g} "
        "ms (both must hold).",
        "- Ceilings (hit rate only): *pooled* = one LRU cache as large as the whole fleet's KV "
        "capacity (a perfect router that never duplicates a block and ignores load).",
    ]


def _load_section(subjects: Sequence[Subject], levels: Sequence[LoadLevel]) -> list[str]:
    parts = [
        "",
        "## Load levels",
        "",
        "A workload's *saturation rate* is the arrival rate at which "
        f"`{SATURATION_POLICY}`'s p95 queue time (arrival to first scheduling) passes "
        f"{SATURATION_QUEUE_P95_MS / 1000:g} s on this fleet, found by sweeping the rate. Load "
        "levels are multiples of it. Past 1× a trace is an overload burst: queues grow for its "
        "whole length (the *span*), so goodput there depends on how long the burst lasts. The "
        f"last column shows how close 1× came to the definition in this run.",
        "",
        "| workload | what | load 1× | req/s at 1× | span at 1× (s) "
        f"| {SATURATION_POLICY} p95 queue at 1× (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for subject in subjects:
        at_one = next((lv for lv in levels if lv.subject == subject.name and lv.scale == 1), None)
        row = at_one.get(SATURATION_POLICY) if at_one is not None else None
        queue = _spread_cell(row.queue_p95_ms, "{:,.0f}") if row is not None else "–"
        span_s = len(subject.traces[min(subject.traces)]) / subject.reference_rate
        parts.append(
            f"| {subject.name} | {subject.what} | {subject.reference} | "
            f"{subject.reference_rate:.4g} | {span_s:.1f} | {queue} |"
        )
    return parts


def _checks_section(verdicts: Sequence[Verdict], default: str) -> list[str]:
    applied = [c for v in verdicts for c in v.checks if c.passed is not None]
    failed = [c for c in applied if not c.passed]
    return [
        "",
        "## Checks",
        "",
        f"What `{default}` must show at each load level, against every other policy replayed "
        f"(means over the level's seeds): *best goodput* — the highest goodput, or within "
        f"{GOODPUT_TIE * 100:g} points of the highest other; *p95 TTFT* — no worse than the "
        f"lowest other; *hit rate* — at least {HIT_RATE_TARGET:g} × the pooled ceiling; "
        f"*goodput margin* — from {MARGIN_FROM_SCALE:g}× up, at least {GOODPUT_MARGIN * 100:g} "
        "points above the best other goodput.",
        "",
        f"**{len(applied) - len(failed)} of {len(applied)} checks pass; {len(failed)} fail.**",
        "",
        checks_table(verdicts),
    ]


def _subject_section(
    subject: Subject,
    levels: Sequence[LoadLevel],
    results: Sequence[PointResult],
    ctx: PageContext,
) -> list[str]:
    mine = [lv for lv in levels if lv.subject == subject.name]
    if not mine:
        return []
    plots = ctx.plot_dir
    parts = [
        "",
        f"### {subject.name}",
        "",
        f"{subject.what}. 1× = {subject.reference_rate:.4g} req/s: {subject.reference}.",
        "",
        "Goodput (share of requests within both SLOs):",
        "",
        sweep_table(mine, lambda p: p.goodput, "{:.1f}", ctx.default, percent=True),
        "",
        "p95 TTFT (ms):",
        "",
        sweep_table(mine, lambda p: p.ttft_p95_ms, "{:,.0f}", ctx.default),
        "",
        "Prefix hit rate:",
        "",
        sweep_table(mine, lambda p: p.hit_rate, "{:.1f}", ctx.default, percent=True, pooled=True),
        "",
        f"![goodput vs load, {subject.name}]({plots}/{subject.name}-goodput_vs_load.png)",
        f"![p95 TTFT vs load, {subject.name}]({plots}/{subject.name}-ttft_p95_vs_load.png)",
        f"![hit rate vs load, {subject.name}]({plots}/{subject.name}-hit_rate_vs_load.png)",
        "",
        "<details><summary>Every figure at each load (seed 0)</summary>",
    ]
    for result in results:
        point = result.point
        if result.subject == subject.name and point.seed == 0:
            parts += [
                "",
                f"**{point.rate_scale:g}×** — {point.rate:.4g} req/s",
                "",
                markdown_table(point.report, ctx.default),
            ]
    parts += ["", "</details>"]
    return parts


def _refused(subjects: Sequence[Subject], results: Sequence[PointResult]) -> list[str]:
    """A line naming the requests the engines refused, where a workload has any: lengths alone
    decide it (prompt + output over the model's context, or over the KV cache), so every policy
    and load refuses the same ones, and every figure and ceiling leaves them out."""
    counts = {}
    for subject in subjects:
        refused = max(
            (max(r.rejected.values(), default=0) for r in results if r.subject == subject.name),
            default=0,
        )
        if refused:
            counts[subject.name] = refused
    if not counts:
        return []
    listed = ", ".join(f"{name} {n:,}" for name, n in counts.items())
    return [
        f"- Refused by the engines, as vLLM answers 400 (prompt + output over the model's "
        f"context, or over the KV cache): {listed} request(s) per point. Lengths alone decide, "
        "so every policy and load refuses the same ones; they are left out of every figure "
        "and of the ceilings."
    ]


def render_markdown(
    subjects: Sequence[Subject],
    results: Sequence[PointResult],
    verdicts: Sequence[Verdict],
    ctx: PageContext,
) -> str:
    """The whole benchmark page."""
    levels = load_levels(results)
    parts = _header(ctx) + _refused(subjects, results)
    parts += _load_section(subjects, levels) + _checks_section(verdicts, ctx.default)
    parts += [
        "",
        "## The sweep per workload",
        "",
        "Times in ms. *hit rate* = cached prompt tokens / prompt tokens as the engines counted "
        "them; *goodput* = share of requests within both SLOs; *$/1M out* = fleet price × "
        "makespan / output tokens; *imbalance* = max / mean requests per replica. In the "
        "plots the default policy is the thick black line; bars span the seeds' min–max.",
    ]
    for subject in subjects:
        parts += _subject_section(subject, levels, results, ctx)
    parts.append("")
    return "\n".join(parts)


# --------------------------------------------------------------------------- speed check


def long_prompt_trace(requests: int, rate: float, seed: int = 0) -> list[TraceRecord]:
    """~12k-token prompts: a 2k system prompt, one of 200 8k documents (Pareto), a 1-3k tail."""
    rng = random.Random(seed)
    allocator = BlockIdAllocator(512)
    records = []
    now = 0.0
    for index in range(requests):
        now += rng.expovariate(rate)
        document = min(int(rng.paretovariate(1.0)), 200)
        segments = [
            Segment("system", 2000),
            Segment(("document", document), 8000),
            Segment(("question", index), rng.randint(1000, 3000)),
        ]
        records.append(
            TraceRecord(
                round(now * 1000),
                sum(s.length for s in segments),
                rng.randint(100, 400),
                tuple(allocator.hash_ids(segments)),
            )
        )
    return records


def speed_check(policies: Sequence[str]) -> int:
    """Time the simulator on 10,000 ~12k-token requests over 8 replicas, per policy."""
    records = long_prompt_trace(10_000, 25.0)
    requests = prepare_requests(records)
    mean_input = sum(r.input_length for r in records) / len(records)
    print(f"10,000 requests, mean prompt {mean_input:,.0f} tokens, 8 replicas")
    for policy in policies:
        started = time.process_time()
        wall = time.perf_counter()
        report = simulate(requests, [policy], SimulationConfig(replicas=8))
        print(
            f"{policy}: {time.perf_counter() - wall:.1f} s wall, "
            f"{time.process_time() - started:.1f} s CPU; "
            f"hit rate {report.summaries[0].prefix_hit_rate:.1%}, "
            f"TTFT p95 {report.summaries[0].ttft_p95_ms:.0f} ms"
        )
    return 0


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing_quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    every = ",".join(w.shape for w in WORKLOADS)
    parser.add_argument(
        "--workloads", default=every, metavar="A,B", help=f"workload shapes (default: {every})"
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="sweep this Mooncake-format JSONL trace instead of the generated workloads; load "
        "1x is the trace's own rate, or its saturation rate with --find-saturation",
    )
    parser.add_argument(
        "--trace-block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="N",
        help=f"prompt tokens per hash id in --trace (default: {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--find-saturation",
        action="store_true",
        help=f"measure each saturation rate first ({SATURATION_POLICY}'s p95 queue time passing "
        f"{SATURATION_QUEUE_P95_MS:g} ms, 6-12 quick replays) and make it load 1x",
    )
    parser.add_argument(
        "--scales",
        type=rate_scales,
        default=DEFAULT_SCALES,
        metavar="X,Y",
        help="load levels, multiples of load 1x (default: 0.5,1,2,3,4)",
    )
    parser.add_argument(
        "--spread-scales",
        type=rate_scales,
        default=SPREAD_SCALES,
        metavar="X,Y",
        help="load levels replayed with --seeds seeds (default: 1,3); others use seed 0",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=DEFAULT_SEEDS,
        metavar="N",
        help=f"seeds 0..N-1 at the spread levels (default: {DEFAULT_SEEDS})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help=f"requests per trace (default: {DEFAULT_REQUESTS}; with --trace, the whole file)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(BUILTIN_PROFILES),
        metavar="A,B",
        help="comma-separated policies (default: every built-in)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=POLICY:key=value,…",
        help="also replay built-in POLICY with these plugin parameters, as NAME (repeatable; "
        "e.g. d05=fleet-cost:decode_weight=0.05); reported, never a baseline for the checks",
    )
    parser.add_argument(
        "--arrival-spread-ms",
        type=int,
        default=0,
        metavar="MS",
        help="with --trace: move each arrival later by a seeded uniform draw from [0, MS) ms, "
        "for traces whose timestamps are coarse (Mooncake's conversation trace: 3000); each "
        "seed is then one placement of the arrivals within their buckets (default: 0, as "
        "recorded)",
    )
    parser.add_argument(
        "--replicas", type=int, help="fleet size (default: 8, or a mixed --profile's counts)"
    )
    parser.add_argument(
        "--profile",
        default="h100-llama3-8b",
        metavar="NAME|NAME:N,NAME:N",
        help="engine preset of every replica (default: h100-llama3-8b), or a mixed fleet as "
        "fleetgate simulate takes it (h100-llama3-8b:4,a100-llama3-8b:4). The generated "
        "workloads keep their rates (measured on eight H100s): with another fleet, add "
        "--find-saturation",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        metavar="N",
        help="worker processes, one load level and seed each (default: 2, or 1 on one CPU)",
    )
    parser.add_argument(
        "--out",
        metavar="PAGE",
        help=f"the page to write, PNGs in PAGE without .md (default: {DEFAULT_PAGE}; with "
        "--trace, FILE's name with .routing-quality.md next to it)",
    )
    parser.add_argument(
        "--speed-check", action="store_true", help="time the 10k x 12k-token replay instead"
    )
    return parser


@dataclass(frozen=True)
class Plan:
    """The validated command line of one sweep."""

    subjects: tuple[Subject, ...]
    policies: tuple[str, ...]
    variants: tuple[PolicyVariant, ...]
    scales: tuple[float, ...]
    spread_scales: tuple[float, ...]
    seeds: int
    requests: int
    config: SimulationConfig
    jobs: int
    out: Path


def _plan(args: argparse.Namespace) -> Plan:
    """Check the flags and build the subjects; raises ValueError on a bad flag."""
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in BUILTIN_PROFILES]
    if unknown or not policies:
        raise ValueError(
            f"unknown policy {unknown[0] if unknown else '(none)'}; choose from: "
            + ", ".join(BUILTIN_PROFILES)
        )
    variants = tuple(parse_variant(spec) for spec in args.variant)
    names = [*policies, *(v.name for v in variants)]
    if len(set(names)) != len(names):
        raise ValueError(f"--variant: names must be unique and differ from --policies ({names})")
    for flag in ("seeds", "replicas", "jobs", "requests"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1 (got {value})")
    if args.arrival_spread_ms < 0:
        raise ValueError(f"--arrival-spread-ms must be >= 0 (got {args.arrival_spread_ms})")
    if args.arrival_spread_ms and not args.trace:
        raise ValueError(
            "--arrival-spread-ms spreads a recorded trace's timestamps; it needs --trace "
            "(a generated workload's arrivals are already drawn per seed)"
        )
    seeds = range(args.seeds)
    mix = parse_profile_mix(args.profile, args.replicas or 8)
    replicas = sum(count for _, count in mix)
    if args.replicas is not None and args.replicas != replicas:
        raise ValueError(f"--profile {args.profile} makes {replicas} replicas, not {args.replicas}")
    config = SimulationConfig(
        replicas=replicas, profile=args.profile, trace_block_size=args.trace_block_size
    )
    if args.trace:
        subjects: tuple[Subject, ...] = (
            trace_subject(
                args.trace, args.trace_block_size, args.requests, seeds, args.arrival_spread_ms
            ),
        )
        out = Path(args.out or Path(args.trace).with_suffix(".routing-quality.md"))
    else:
        chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
        known = {w.shape: w for w in WORKLOADS}
        missing = [w for w in chosen if w not in known]
        if missing or not chosen:
            raise ValueError(
                f"unknown workload {missing[0] if missing else '(none)'}; choose "
                "from: " + ", ".join(known)
            )
        requests = args.requests or DEFAULT_REQUESTS
        subjects = tuple(generated_subject(known[w], requests, seeds) for w in chosen)
        out = Path(args.out or DEFAULT_PAGE)
    requests = max(len(next(iter(s.traces.values()))) for s in subjects)
    return Plan(
        subjects,
        policies,
        variants,
        args.scales,
        args.spread_scales,
        args.seeds,
        requests,
        config,
        args.jobs,
        out,
    )


def _measured(subject: Subject, config: SimulationConfig) -> Subject:
    """``subject`` with load 1x at its measured saturation rate (seed 0's trace)."""
    began = time.perf_counter()
    search = find_saturation(subject.traces[0], subject.trace_rate, config)
    probes = ", ".join(f"{p.rate:.4g} req/s: {p.queue_p95_ms:,.0f} ms" for p in search.probes)
    print(
        f"{subject.name}: saturation {search.rate:.4g} req/s ({subject.reference}: "
        f"{subject.reference_rate:.4g}) in {time.perf_counter() - began:.0f} s; "
        f"{SATURATION_POLICY} p95 queue at {probes}",
        file=sys.stderr,
        flush=True,
    )
    return replace(subject, reference_rate=search.rate, reference="the saturation rate (measured)")


def tasks_for(plan: Plan) -> list[PointTask]:
    """Every (subject, load, seed) of the plan."""
    return [
        PointTask(
            subject.name,
            scale,
            seed,
            subject.factor(scale),
            subject.traces[seed],
            plan.policies,
            plan.config,
            plan.variants,
        )
        for subject in plan.subjects
        for scale in plan.scales
        for seed in seeds_at(scale, plan.spread_scales, plan.seeds)
    ]


def _command(argv: Sequence[str] | None) -> str:
    given = list(sys.argv[1:] if argv is None else argv)
    return " ".join([".venv/bin/python -m bench.routing_quality", shlex.join(given)]).rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep, print the checks and rewrite the page (or run the speed check)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.speed_check:
        given = [p for p in args.policies.split(",") if p]
        default_given = args.policies == parser.get_default("policies")
        return speed_check(["round-robin", default_policy()] if default_given else given)
    try:
        plan = _plan(args)
        if args.find_saturation:
            plan = replace(plan, subjects=tuple(_measured(s, plan.config) for s in plan.subjects))
    except (ValueError, OSError, TraceFormatError) as exc:
        parser.error(str(exc))
    tasks = tasks_for(plan)
    started = time.perf_counter()
    done = 0

    def report(result: PointResult) -> None:
        nonlocal done
        done += 1
        point = result.point
        refused = f"; refused {dict(result.rejected)}" if result.rejected else ""
        print(
            f"[{done}/{len(tasks)}] {result.subject} {point.rate_scale:g}x seed {point.seed}: "
            f"{result.wall_s:.0f} s wall, {result.cpu_s:.0f} s CPU ({point.rate:.4g} req/s)"
            f"{refused}",
            file=sys.stderr,
            flush=True,
        )

    results = run_points(tasks, plan.jobs, report)
    default = default_policy()
    verdicts = [v for lv in load_levels(results) if (v := evaluate(lv, default)) is not None]
    print(checks_text(verdicts))
    plot_dir = plan.out.with_suffix("")
    for subject in plan.subjects:
        points = [r.point for r in results if r.subject == subject.name]
        write_load_plots(
            points,
            plot_dir,
            prefix=f"{subject.name}-",
            title=subject.name,
            x_label=f"load (multiple of {subject.reference_rate:.4g} req/s)",
            slo_ttft_ms=plan.config.slo_ttft_ms,
        )
    ctx = PageContext(
        _command(argv),
        time.perf_counter() - started,
        sum(r.cpu_s for r in results),
        plan.jobs,
        plan.requests,
        plan.config,
        plot_dir.name,
        plan.scales,
        plan.spread_scales,
        plan.seeds,
        default,
    )
    # Hand-written notes below ``NOTES_MARKER`` survive the rewrite.
    write_page(plan.out, render_markdown(plan.subjects, results, verdicts, ctx))
    print(f"wrote {plan.out} and {plot_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
