"""Flow control on vs off, 0.5x-4x of saturation: per-class goodput, shedding, gateway queue waits.

Usage::

    python -m bench.flow_control                      # the committed page and PNGs
    python -m bench.flow_control --requests 600 --workloads rag,agent --out /tmp/fc.md
    python -m bench.flow_control --workloads none --trace FILE   # a recorded trace only

Each subject (the generated workloads at their saturation rate, ``bench.routing_quality``'s
table, and a Mooncake-conversation-shaped trace) is replayed at each load through the default
routing policy twice, with and without the gateway's flow control, with the same classes
(``critical=0.2,standard=0.5,sheddable=0.3`` by conversation). The must-show criteria of issue 14
are checked per point and printed PASS/FAIL:

* critical goodput with flow control >= 95% at every load;
* standard goodput with flow control > without, at every load >= 2x;
* overall goodput (refused requests count as misses) with flow control >= without;
* at <= 1x nothing is refused and no request waits in the gateway queue longer than 10 ms.

Beside them, each subject is also served **alone**: one request at a time, in trace order, with
the same classes. What a class misses there (a 60k-token prompt whose prefill alone outlasts the
TTFT SLO) no flow control and no routing can win back, so it bounds every figure above it.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bench.routing_quality import WORKLOADS
from bench.workloads.blocks import BlockIdAllocator, Segment
from bench.workloads.generators import generate
from planning.simulator import SimulationConfig, prepare_requests, simulate
from planning.simulator.flow import parse_class_mix
from planning.simulator.summary import PolicySummary, default_policy
from routing.flow_control import FlowControlSettings
from traces.format import DEFAULT_BLOCK_SIZE, TraceFormatError, TraceRecord, read_trace
from traces.spread import spread_arrivals

DEFAULT_MIX = "critical=0.2,standard=0.5,sheddable=0.3"
DEFAULT_SCALES = (0.5, 1.0, 2.0, 3.0, 4.0)
#: Requests per generated subject: the length at which ``bench.routing_quality`` measured the
#: saturation rates. Past saturation a shorter trace is a shorter burst: at 300 requests rag
#: at "4x" still met every SLO without flow control, so there was no overload to manage.
DEFAULT_REQUESTS = 2000
DEFAULT_PAGE = "docs/benchmarks/flow-control.md"
CRITICAL_TARGET = 0.95
IDLE_WAIT_MS = 10.0
MOONCAKE_LIKE = "mooncake-like"
#: Arrival gap when each request is served alone: longer than any request of these traces takes
#: (a 190k-token prompt and a thousand output tokens), so no two share an engine step.
ALONE_GAP_MS = 120_000


@dataclass(frozen=True)
class Point:
    """One subject at one load: the same policy with flow control on and off."""

    subject: str
    scale: float
    on: PolicySummary
    off: PolicySummary


@dataclass(frozen=True)
class Check:
    """One criterion at one point."""

    subject: str
    scale: float
    name: str
    #: None: no request of the class the criterion is about, at this point; nothing to judge,
    #: so it counts neither as passed nor as failed.
    passed: bool | None
    detail: str

    @property
    def verdict(self) -> str:
        """PASS, FAIL or n/a."""
        return "n/a" if self.passed is None else "PASS" if self.passed else "FAIL"


def mooncake_like_trace(requests: int, seed: int = 0) -> list[TraceRecord]:
    """A trace with the statistics of Mooncake's public conversation trace (not in this repo).

    Arrivals in 3-second ticks of ~10 requests; prompts ~13k tokens on average with a heavy
    tail; 512-token blocks; ~30% of requests continue an earlier conversation (its whole
    history, plus a new turn), seconds to minutes later.
    """
    rng = random.Random(f"{seed}:mooncake-like")
    allocator = BlockIdAllocator(512)
    conversations: list[list[Segment]] = []
    records = []
    tick = 0
    while len(records) < requests:
        for _ in range(max(1, round(rng.gauss(10, 3)))):
            if conversations and rng.random() < 0.3:
                history = rng.choice(conversations)
                history.append(Segment(("turn", len(records)), rng.randint(200, 2000)))
            else:
                length = min(120_000, int(rng.paretovariate(1.6) * 5000))
                history = [Segment(("system", rng.randrange(4)), 1000)]
                history.append(Segment(("doc", len(records)), max(200, length)))
                conversations.append(history)
            segments = list(history)
            stamp = tick * 3000 + rng.randrange(3000)
            records.append(
                TraceRecord(
                    stamp,
                    sum(s.length for s in segments),
                    rng.randint(50, 500),
                    tuple(allocator.hash_ids(segments)),
                )
            )
            if len(records) == requests:
                break
        tick += 1
    records.sort(key=lambda r: r.timestamp)
    return records


def workload_names(text: str) -> list[str]:
    """``--workloads``: generated subjects, comma-separated; ``none`` or empty for none (only the
    ``--trace`` files). An unknown name is refused: a typo would otherwise replay nothing and
    report every check passed."""
    known = [w.shape for w in WORKLOADS] + [MOONCAKE_LIKE]
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown subject {', '.join(map(repr, unknown))} (valid: {', '.join(known)}; "
            "none: only the --trace files)"
        )
    return names


def subjects(names: Sequence[str], requests: int) -> dict[str, tuple[list[TraceRecord], float]]:
    """Subject name -> (trace, the rate scale that makes it 1x)."""
    chosen: dict[str, tuple[list[TraceRecord], float]] = {}
    for workload in WORKLOADS:
        if workload.shape in names:
            trace = generate(workload.shape, requests, workload.saturation_rate, seed=0)
            chosen[workload.shape] = (trace, 1.0)
    if MOONCAKE_LIKE in names:
        chosen[MOONCAKE_LIKE] = (mooncake_like_trace(requests), 1.0)
    return chosen


def run_point(
    subject: str,
    trace: Sequence[TraceRecord],
    scale: float,
    mix: str,
    settings: FlowControlSettings,
    engine_priority: bool = False,
    seed: int = 0,
) -> Point:
    """The default policy at ``scale`` x, flow control off and on, same classes; with
    ``engine_priority`` the engines schedule by the classes (vLLM's priority policy) in both.
    ``seed`` draws the classes and routing's random choices."""
    classes = parse_class_mix(mix)
    requests = prepare_requests(trace, rate_scale=scale, seed=seed)
    policy = default_policy()
    engine = {"scheduling_policy": "priority"} if engine_priority else {}
    rows = {}
    for flow in (False, True):
        config = SimulationConfig(
            classes=classes,
            flow_control=settings if flow else None,
            engine_overrides=engine,
            seed=seed,
        )
        rows[flow] = simulate(requests, [policy], config).summaries[0]
    return Point(subject, scale, rows[True], rows[False])


def served_alone(
    trace: Sequence[TraceRecord], mix: str, engine_priority: bool = False, seed: int = 0
) -> PolicySummary:
    """The default policy serving ``trace`` one request at a time, in trace order: the same
    prompts, classes and prefix reuse without load. A miss there is the request's own: its
    prefill or decode alone outlasts the SLO."""
    one_by_one = [replace(r, timestamp=i * ALONE_GAP_MS) for i, r in enumerate(trace)]
    engine = {"scheduling_policy": "priority"} if engine_priority else {}
    config = SimulationConfig(classes=parse_class_mix(mix), engine_overrides=engine, seed=seed)
    requests = prepare_requests(one_by_one, seed=seed)
    return simulate(requests, [default_policy()], config).summaries[0]


def _class(row: PolicySummary, name: str) -> float:
    return (row.goodput_by_class or {}).get(name, float("nan"))


def check(point: Point, alone: PolicySummary | None = None) -> list[Check]:
    """The issue's criteria at one point; ``alone``: the subject served one request at a time,
    whose critical goodput is quoted beside the criterion (the most any load can reach)."""
    on, off = point.on, point.off
    checks = []

    def add(name: str, passed: bool | None, detail: str) -> None:
        checks.append(Check(point.subject, point.scale, name, passed, detail))

    # A class with no request at a point has no goodput (NaN): its check reads n/a.
    critical = _class(on, "critical")
    if math.isnan(critical):
        add("critical >= 95%", None, "no critical request")
    else:
        ceiling = "" if alone is None else f" (served alone: {_pct(_class(alone, 'critical'))})"
        add("critical >= 95%", critical >= CRITICAL_TARGET, f"{critical:.1%}{ceiling}")
    if point.scale >= 2.0:
        mine, theirs = _class(on, "standard"), _class(off, "standard")
        if math.isnan(mine) or math.isnan(theirs):
            add("standard on > off", None, "no standard request")
        else:
            add("standard on > off", mine > theirs, f"{mine:.1%} vs {theirs:.1%}")
    goodput_on, goodput_off = on.goodput or 0.0, off.goodput or 0.0
    add("overall on >= off", goodput_on >= goodput_off, f"{goodput_on:.1%} vs {goodput_off:.1%}")
    if point.scale <= 1.0:
        wait = on.gateway_wait_max_ms or 0.0
        add(
            "<=1x: none shed, wait <= 10 ms",
            on.shed == 0 and wait <= IDLE_WAIT_MS,
            f"shed {on.shed}, max wait {wait:.1f} ms",
        )
    return checks


def _pct(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.1%}"


def points_table(points: Sequence[Point]) -> str:
    """One markdown row per point."""
    lines = [
        "| subject | load | goodput off → on | critical off → on | standard off → on "
        "| sheddable off → on | shed (on) | queued (on) | steered (on) "
        "| gateway wait p95 / max (on) | p95 TTFT off → on |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        cells = [
            p.subject,
            f"{p.scale:g}×",
            f"{_pct(p.off.goodput)} → {_pct(p.on.goodput)}",
            *(
                f"{_pct(_class(p.off, c))} → {_pct(_class(p.on, c))}"
                for c in ("critical", "standard", "sheddable")
            ),
            str(p.on.shed),
            str(p.on.queued),
            str(p.on.steered),
            f"{p.on.gateway_wait_p95_ms or 0:,.0f} / {p.on.gateway_wait_max_ms or 0:,.0f} ms",
            f"{p.off.ttft_p95_ms or 0:,.0f} → {p.on.ttft_p95_ms or 0:,.0f} ms",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def alone_table(alone: dict[str, PolicySummary]) -> str:
    """Per subject, the goodput of each class when every request is served alone."""
    lines = [
        "| subject | overall | critical | standard | sheddable |",
        "|---|---|---|---|---|",
    ]
    for subject, row in alone.items():
        cells = [_pct(_class(row, c)) for c in ("critical", "standard", "sheddable")]
        lines.append(f"| {subject} | {_pct(row.goodput)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks_table(checks: Sequence[Check]) -> str:
    """Every check, PASS, FAIL or n/a."""
    lines = ["| subject | load | criterion | result | figures |", "|---|---|---|---|---|"]
    for c in checks:
        verdict = "**FAIL**" if c.passed is False else c.verdict
        lines.append(f"| {c.subject} | {c.scale:g}× | {c.name} | {verdict} | {c.detail} |")
    return "\n".join(lines)


def write_plots(points: Sequence[Point], directory: Path) -> list[Path]:
    """Per subject: goodput per class against load, flow control on (solid) and off (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for subject in dict.fromkeys(p.subject for p in points):
        mine = [p for p in points if p.subject == subject]
        scales = [p.scale for p in mine]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series = [("overall", None, "black"), ("critical", "critical", "tab:red")]
        series += [("standard", "standard", "tab:blue"), ("sheddable", "sheddable", "tab:gray")]
        for label, name, color in series:
            for flow, style in ((True, "-"), (False, "--")):

                def value(p: Point, name: str | None = name, flow: bool = flow) -> float:
                    row = p.on if flow else p.off
                    return 100 * ((row.goodput or 0.0) if name is None else _class(row, name))

                ax.plot(
                    scales,
                    [value(p) for p in mine],
                    style,
                    marker="o" if flow else None,
                    color=color,
                    label=f"{label} ({'on' if flow else 'off'})",
                )
        ax.axhline(100 * CRITICAL_TARGET, color="tab:red", linestyle=":", linewidth=0.8)
        ax.set_ylim(0, 102)
        ax.set_xticks(scales, [f"{x:g}×" for x in scales])
        ax.set_xlabel("load (× saturation rate)")
        ax.set_ylabel("goodput (% of requests within both SLOs; refused = miss)")
        ax.set_title(f"{subject}: goodput by class, flow control on (solid) / off (dashed)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
        path = directory / f"{subject}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def render_page(
    points: Sequence[Point],
    checks: Sequence[Check],
    command: str,
    settings: FlowControlSettings,
    requests: int,
    plots: Sequence[Path],
    page: Path,
    elapsed_s: float,
    trace_sizes: dict[str, int] | None = None,
    engine_priority: bool = False,
    alone: dict[str, PolicySummary] | None = None,
) -> str:
    """The markdown page; ``trace_sizes``: the ``--trace`` subjects and requests replayed;
    ``alone``: each subject served one request at a time."""
    failed = [c for c in checks if c.passed is False]
    judged = [c for c in checks if c.passed is not None]
    real = ""
    if trace_sizes:
        named = ", ".join(f"`{name}` ({n:,} requests)" for name, n in trace_sizes.items())
        real = (
            f" Real traces (`--trace`, see the command): {named}, replayed as recorded, 1× "
            "being the trace's own rate."
        )
    lines = [
        "# Flow control: goodput by class with and without it, "
        f"{_span(p.scale for p in points)} of saturation",
        "",
        f"Command: `{command}` ({elapsed_s:.0f} s on this machine's 2 shared cores).",
        "",
        f"Each subject is replayed through the default policy (`{default_policy()}`) on 8 "
        "simulated H100s (`h100-llama3-8b`), TTFT SLO 2,000 ms and TPOT SLO 50 ms, with the "
        f"classes `{DEFAULT_MIX}` assigned by conversation, once without flow control and once "
        "with it, in the same run. Flow control settings: saturation when every replica is "
        f"full by what its engine reports ({settings.saturation_backlog_requests} or more "
        "requests waiting to start there, or KV usage at least "
        f"{settings.saturation_kv_usage:g}){_optional_bounds(settings)}; queue of "
        f"{settings.max_queue_length}; queued requests leave when they can no longer meet "
        "their TTFT SLO. Refused requests count as misses in every goodput figure."
        + (
            " The engines schedule by priority (vLLM's `--scheduling-policy priority`; the "
            "gateway's `flow_control.engine_priority`): each request carries its class as "
            "vLLM's `priority`, with flow control off and on alike."
            if engine_priority
            else ""
        ),
        "",
        f"{requests:,} requests per generated trace. The generated workloads arrive at "
        "`bench.routing_quality`'s saturation rates, measured on 2,000-request traces: the "
        "rate at which `least-loaded`'s p95 queue time passes 1 s. That is a queueing knee, not "
        "an SLO one: on rag and rag-cache-buster most requests already miss the 50 ms TPOT SLO "
        "at 1× without flow control. The Mooncake-like trace is a synthetic stand-in with the "
        "public conversation trace's statistics (3-second ticks of ~10 requests, ~13k-token "
        "prompts with a heavy tail, ~30% continuing an earlier conversation), 1× being its own "
        "rate."
        + real,
        "",
        f"**Checks: {len(judged) - len(failed)} of {len(judged)} pass"
        f"{_not_judged(len(checks) - len(judged))}.**",
        "",
        "## Points",
        "",
        points_table(points),
        "",
        "## Checks (issue 14's must-show criteria)",
        "",
        checks_table(checks),
        "",
    ]
    if alone:
        lines += [
            "## Served alone: what no load can beat",
            "",
            "Goodput by class when each subject's requests are served one at a time, in "
            f"trace order ({ALONE_GAP_MS // 1000} s apart, the same classes and prefix reuse): "
            "a miss there is the request's own (its prefill or its decode alone outlasts the "
            "SLO), so no routing or flow control can win it back, at any load.",
            "",
            alone_table(alone),
            "",
        ]
    lines += [
        "## Plots",
        "",
    ]
    for path in plots:
        rel = path.relative_to(page.parent) if path.is_relative_to(page.parent) else path
        lines += [f"![{path.stem}]({rel})", ""]
    return "\n".join(lines)


def _span(scales: Iterable[float]) -> str:
    """``0.5×–4×``: the loads a page replayed."""
    ordered = sorted(set(scales))
    if len(ordered) < 2:
        return "".join(f"{x:g}×" for x in ordered)
    return f"{ordered[0]:g}×–{ordered[-1]:g}×"


def _not_judged(count: int) -> str:
    """What a checks count says of the checks read n/a (none: nothing)."""
    return f" ({count} n/a: no request of their class)" if count else ""


def _optional_bounds(settings: FlowControlSettings) -> str:
    parts = []
    if settings.saturation_queue_wait_ms is not None:
        parts.append(f"predicted queue wait over {settings.saturation_queue_wait_ms:g} ms")
    if settings.saturation_decode_interference_ms is not None:
        parts.append(f"decode interference over {settings.saturation_decode_interference_ms:g} ms")
    if settings.saturation_itl_fraction is not None:
        moving = (
            ""
            if settings.tpot_target is None
            else f", a bound that each finished request moves between "
            f"{settings.min_itl_fraction:g} and {settings.max_itl_fraction:g} x: down for a TPOT "
            f"miss, up for a TPOT met, settling where {1 - settings.tpot_target:.0%} miss"
        )
        parts.append(
            f"engine inter-token latency over {settings.saturation_itl_fraction:g} x the TPOT "
            f"SLO at first{moving}"
        )
    held = (
        "; and, while decodes miss their TPOT (the bound below its start) and any replica is "
        "full, a standard or sheddable request whose prefill would push a critical decode on "
        "its chosen replica past its TPOT SLO waits "
        "(`protect_critical_decodes`)"
        if settings.protect_critical_decodes
        else ""
    )
    steered = (
        "; a critical request routed to a replica whose decodes run too slow for its TPOT "
        "SLO, and not already past its TTFT SLO there, is routed again among the replicas with "
        "room and goes there when its expected TTFT is no worse (`steer_critical`)"
        if settings.steer_critical
        else ""
    )
    calm = (
        "; a standard or sheddable request that would be held for the same reason while the "
        f"fleet is calm (nothing queued or held for {settings.calm_window_s:g} s) is routed "
        "again among the replicas with room and admitted there when its expected TTFT meets "
        "its SLO (`steer_when_calm`)"
        if settings.steer_when_calm
        else ""
    )
    backlog = (
        "; once at least half the fleet is full, a queued request routed to a replica with "
        f"{settings.saturation_backlog_requests} or more waiting is not released there, and, "
        "held for that alone, goes to an idle replica when what it waited plus its expected "
        "TTFT there meets its SLO (`hold_for_backlog`)"
        if settings.hold_for_backlog
        else ""
    )
    return (f" or {' or '.join(parts)}" if parts else "") + held + steered + calm + backlog


def _seeds(text: str) -> list[int]:
    """``0`` or ``0,1,2``: the seeds to replay with."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"seeds are integers, comma-separated (got {text!r})"
        ) from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"a seed is named twice in {text!r}")
    return seeds


def _optional_share(text: str) -> float | None:
    """A share in (0, 1), or ``none``."""
    return None if text.strip().lower() == "none" else float(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.flow_control", description=__doc__)
    names = [w.shape for w in WORKLOADS] + [MOONCAKE_LIKE]
    parser.add_argument(
        "--workloads",
        type=workload_names,
        default=names,
        help="generated subjects to replay, comma-separated; none: only the --trace files "
        f"(default: all: {','.join(names)})",
    )
    parser.add_argument("--scales", default=",".join(f"{x:g}" for x in DEFAULT_SCALES))
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--classes", default=DEFAULT_MIX)
    defaults = FlowControlSettings()
    parser.add_argument(
        "--saturation-backlog-requests",
        type=int,
        default=defaults.saturation_backlog_requests,
        help="a replica is full when this many requests wait to start on it",
    )
    parser.add_argument(
        "--saturation-kv-usage",
        type=float,
        default=defaults.saturation_kv_usage,
        help="... or its KV cache usage is at least this fraction",
    )
    parser.add_argument(
        "--saturation-queue-wait-ms",
        type=float,
        default=None,
        help="optional: also full when its predicted queue wait is over this (off by default)",
    )
    parser.add_argument(
        "--saturation-decode-interference-ms",
        type=float,
        default=None,
        help="optional: also full when its decode interference is over this (off by default)",
    )
    parser.add_argument(
        "--admit-within-slo-fraction",
        type=float,
        default=defaults.admit_within_slo_fraction,
        help="admit a request whose predicted TTFT is at most this fraction of its SLO, "
        "saturated or not (default %(default)s)",
    )
    parser.add_argument(
        "--saturation-itl-fraction",
        type=float,
        default=defaults.saturation_itl_fraction,
        help="also full when its engine's recent inter-token latency is over this fraction of "
        "the TPOT SLO",
    )
    parser.add_argument(
        "--tpot-target",
        type=_optional_share,
        default=defaults.tpot_target,
        metavar="SHARE|none",
        help="share of requests (every class) that should meet their TPOT SLO: each TPOT miss "
        "lowers the inter-token bound, each met one raises it (default %(default)s; none: the "
        "bound stays fixed)",
    )
    parser.add_argument(
        "--max-itl-fraction",
        type=float,
        default=defaults.max_itl_fraction,
        help="the highest the inter-token bound goes, a fraction of the TPOT SLO "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="also replay this Mooncake-format JSONL trace (repeatable), 1x being its own "
        "rate; e.g. Mooncake's public FAST25-release/traces/conversation_trace.jsonl",
    )
    parser.add_argument(
        "--trace-requests",
        type=int,
        metavar="N",
        help="replay only the first N requests of each --trace (default: the whole file)",
    )
    parser.add_argument(
        "--arrival-spread-ms",
        type=int,
        default=0,
        metavar="MS",
        help="move each --trace arrival later by a uniform draw from [0, MS) ms, seeded by "
        "--seed, for traces with coarse timestamps (Mooncake's conversation trace: 3000; "
        "traces/README.md, Coarse timestamps) (default: 0, as recorded)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        metavar="N",
        help="worker processes, one subject and load each (default: 2, or 1 on one CPU)",
    )
    parser.add_argument(
        "--seed",
        type=_seeds,
        default=[0],
        metavar="N[,N,...]",
        help="draws the classes (by conversation) and routing's random choices; the on/off "
        "comparison of a point near its threshold can flip with it (default 0). Several "
        "(0,1,2) replay everything once per seed and print each seed's checks and mean goodput "
        "and their mean, without a page: judge a change of setting by that mean, not by one "
        "seed",
    )
    parser.add_argument(
        "--engine-priority",
        action="store_true",
        help="engines schedule by priority (vLLM's --scheduling-policy priority), each request "
        "carrying its class as vLLM's priority, with flow control off and on alike",
    )
    parser.add_argument(
        "--protect-critical-decodes",
        action="store_true",
        help="while decodes miss their TPOT and any replica is full, hold a standard or "
        "sheddable request whose prefill would push a critical decode on its chosen replica "
        "past its TPOT SLO "
        "(flow_control.protect_critical_decodes; off by default)",
    )
    parser.add_argument(
        "--no-steer-critical",
        dest="steer_critical",
        action="store_false",
        help="leave a critical request on the replica routing chose even when its decodes run "
        "too slow for the TPOT SLO (flow_control.steer_critical: false)",
    )
    parser.add_argument(
        "--no-steer-when-calm",
        dest="steer_when_calm",
        action="store_false",
        help="hold a standard or sheddable request routed to a replica decoding too slowly, "
        "with most of the fleet full, even on a calm fleet (flow_control.steer_when_calm: false)",
    )
    parser.add_argument(
        "--no-hold-for-backlog",
        dest="hold_for_backlog",
        action="store_false",
        help="release a queued request whenever any replica has room, even onto one where "
        "requests already wait (flow_control.hold_for_backlog: false)",
    )
    parser.add_argument("--out", default=DEFAULT_PAGE, help="markdown page to write")
    parser.add_argument("--no-page", action="store_true", help="print the checks only")
    return parser


def trace_subjects(
    paths: Sequence[str], limit: int | None, arrival_spread_ms: int = 0, seed: int = 0
) -> dict[str, list[TraceRecord]]:
    """Subject name (the file's stem) -> its first ``limit`` requests, each arrival moved later
    by a seeded draw from [0, ``arrival_spread_ms``) ms (0: as recorded; ``traces.spread``)."""
    return {
        Path(p).stem: list(
            spread_arrivals(read_trace(p, DEFAULT_BLOCK_SIZE, limit), arrival_spread_ms, seed)
        )
        for p in paths
    }


@dataclass(frozen=True)
class Replay:
    """Every point of one seed, its checks, and each subject served alone."""

    seed: int
    points: list[Point]
    checks: list[Check]
    alone: dict[str, PolicySummary]

    def mean_goodput(self, flow: bool) -> float:
        """Overall goodput with (``flow``) or without flow control, averaged over the points."""
        rows = [p.on if flow else p.off for p in self.points]
        return sum(r.goodput or 0.0 for r in rows) / max(1, len(rows))

    @property
    def passed(self) -> int:
        return sum(c.passed is True for c in self.checks)

    @property
    def judged(self) -> int:
        """Checks that had something to judge (not n/a)."""
        return sum(c.passed is not None for c in self.checks)


def replay(
    chosen: dict[str, tuple[list[TraceRecord], float]],
    scales: Sequence[float],
    args: argparse.Namespace,
    settings: FlowControlSettings,
    seed: int,
    pool: ProcessPoolExecutor,
    label: str = "",
) -> Replay:
    """Every subject at every scale with ``seed``, its checks printed as they come."""
    tasks = [(subject, trace, scale) for subject, (trace, _) in chosen.items() for scale in scales]
    futures = [
        pool.submit(
            run_point, subject, trace, scale, args.classes, settings, args.engine_priority, seed
        )
        for subject, trace, scale in tasks
    ]
    alone_futures = {
        subject: pool.submit(served_alone, trace, args.classes, args.engine_priority, seed)
        for subject, (trace, _) in chosen.items()
    }
    points: list[Point] = []
    checks: list[Check] = []
    for (subject, _, scale), future in zip(tasks, futures, strict=True):
        point = future.result()  # in task order: the printout reads like the page
        points.append(point)
        for c in check(point, alone_futures[subject].result()):
            checks.append(c)
            print(
                f"{label}{c.verdict:4}  {subject:17} {scale:g}x  "
                f"{c.name:32} {c.detail}",
                flush=True,
            )
    alone = {subject: f.result() for subject, f in alone_futures.items()}
    return Replay(seed, points, checks, alone)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.arrival_spread_ms < 0:
        parser.error(f"--arrival-spread-ms must be >= 0 (got {args.arrival_spread_ms})")
    for flag, count in (("--requests", args.requests), ("--trace-requests", args.trace_requests)):
        if count is not None and count < 1:
            parser.error(f"{flag} must be >= 1 (got {count})")
    try:
        scales = [float(x) for x in args.scales.split(",")]
    except ValueError:
        scales = []
    if not scales or not all(math.isfinite(x) and x > 0 for x in scales):
        parser.error(f"--scales takes positive load multiples, e.g. 0.5,1,2 (got {args.scales!r})")
    if not args.workloads and not args.trace:
        parser.error("nothing to replay: --workloads none and no --trace")
    seeds: list[int] = args.seed
    try:
        recorded = trace_subjects(args.trace, args.trace_requests)
    except (OSError, TraceFormatError) as exc:
        parser.error(str(exc))
    # Read once; each seed places the arrivals in their buckets its own way.
    traces = {
        seed: {
            name: list(spread_arrivals(trace, args.arrival_spread_ms, seed))
            for name, trace in recorded.items()
        }
        for seed in seeds
    }
    started = time.perf_counter()
    settings = FlowControlSettings(
        saturation_backlog_requests=args.saturation_backlog_requests,
        saturation_kv_usage=args.saturation_kv_usage,
        saturation_queue_wait_ms=args.saturation_queue_wait_ms,
        saturation_decode_interference_ms=args.saturation_decode_interference_ms,
        saturation_itl_fraction=args.saturation_itl_fraction,
        tpot_target=args.tpot_target,
        max_itl_fraction=args.max_itl_fraction,
        admit_within_slo_fraction=args.admit_within_slo_fraction,
        protect_critical_decodes=args.protect_critical_decodes,
        steer_critical=args.steer_critical,
        steer_when_calm=args.steer_when_calm,
        hold_for_backlog=args.hold_for_backlog,
    )
    generated = subjects(args.workloads, args.requests)
    replays: list[Replay] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for seed in seeds:
            chosen = {**generated, **{name: (t, 1.0) for name, t in traces[seed].items()}}
            label = f"seed {seed}  " if len(seeds) > 1 else ""
            replays.append(replay(chosen, scales, args, settings, seed, pool, label))
    elapsed = time.perf_counter() - started
    for r in replays:
        print(
            f"{'seed ' + str(r.seed) + ': ' if len(seeds) > 1 else ''}"
            f"{r.passed} of {r.judged} checks pass{_not_judged(len(r.checks) - r.judged)}; "
            "overall goodput with flow control "
            f"{r.mean_goodput(True):.2%}, without {r.mean_goodput(False):.2%} "
            f"(mean of {len(r.points)} points)"
        )
    if len(seeds) > 1:
        n = len(replays)
        print(
            f"mean of {n} seeds: {sum(r.passed for r in replays) / n:.1f} checks pass; overall "
            f"goodput with flow control {sum(r.mean_goodput(True) for r in replays) / n:.2%}, "
            f"without {sum(r.mean_goodput(False) for r in replays) / n:.2%}"
        )
    print(f"({elapsed:.0f} s)")
    failed = sum(r.judged - r.passed for r in replays)
    if len(seeds) > 1:
        print("several seeds: no page written (a page shows one seed)", file=sys.stderr)
    elif not args.no_page:
        [only] = replays
        page = Path(args.out)
        plots = write_plots(only.points, page.parent / page.stem)
        command = "python -m bench.flow_control " + " ".join(argv or sys.argv[1:])
        page.write_text(
            render_page(
                only.points,
                only.checks,
                command.strip(),
                settings,
                args.requests,
                plots,
                page,
                elapsed,
                {name: len(trace) for name, trace in traces[only.seed].items()},
                args.engine_priority,
                only.alone,
            )
        )
        print(f"wrote {page} and {len(plots)} PNGs", file=sys.stderr)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
