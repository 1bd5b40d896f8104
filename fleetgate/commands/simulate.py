"""``fleetgate simulate``: replay a trace through routing policies in virtual time.

The work is done by ``planning/simulator``; this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING

from fleetgate.commands._args import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from fleetgate.extras import PLAN, missing_extra, progress_available
from planning.simulator.config import parse_profile_mix
from planning.simulator.flow import ClassMix, parse_class_mix
from planning.simulator.policy_file import (
    PolicyFileError,
    file_profile_factories,
    policy_file_profiles,
)
from traces.format import DEFAULT_BLOCK_SIZE, TraceFormatError, TraceRecord, read_trace
from traces.notes import trace_notes
from traces.spread import spread_arrivals

if TYPE_CHECKING:
    from planning.simulator.api import SweepPoint
    from routing.engine import Profile


def default_policies() -> str:
    """Every built-in policy but ``random``: the simplest first, the gateway's default last.

    Derived from the registry so that a new default policy is compared without editing this
    list (the registry lists the smartest first; the table reads better from the simplest up).
    """
    from routing.policies.registry import BUILTIN_PROFILES, DEFAULT_PROFILE

    others = [p for p in reversed(BUILTIN_PROFILES) if p not in ("random", DEFAULT_PROFILE)]
    return ",".join([*others, DEFAULT_PROFILE])


EPILOG = """\
what it does:
  Each policy replays the trace on a fresh fleet of --replicas simulated vLLM engines
  (replica/sim: roofline step times, continuous batching, paged prefix cache, LoRA slots),
  routed by the real routing/ code: the same RoutingEngine and policies as the gateway, a
  block index fed by the engines' KV events and by speculative inserts after each decision,
  in-flight counts per replica, engine gauges polled every --stats-interval-ms.
  Time is virtual: a 10-minute trace takes seconds to a minute of CPU per policy and per
  rate scale (a sweep of 5 scales over 7 policies runs 35 replays; --jobs N runs N at once).

output (one row per policy):
  hit rate        cached prompt tokens / prompt tokens, as the engines counted them
  TTFT, TPOT      p50/p95/p99 time to first token, p50/p95 time per output token (ms)
  queue p95       arrival to first scheduling by the engine (ms)
  goodput         share of requests meeting both --slo-ttft-ms and --slo-tpot-ms
  out tok/s       output tokens / makespan;  $/1M out: fleet price x makespan / output tokens
  imbalance       max / mean requests per replica;  preempt: engine preemptions
  ceilings        unbounded: one replica, infinite cache (the trace's own reuse);
                  pooled: one LRU cache as large as the whole fleet's KV capacity
                  (what a router without duplication keeps under LRU: a reference, not a
                  bound; docs/simulate.md, The ceilings)

load sweep: --rate-scale 0.5,1,2,3,4 replays the trace at each scale in turn (one progress bar
  for all runs) and prints one table per scale. --json rows carry "rate_scale", and "default":
  true on the row of the policy that `fleetgate serve` and `fleetgate up` route with when a
  route names none (false on every other row). With several scales, --plot DIR also writes
  goodput_vs_load.png, ttft_p95_vs_load.png and hit_rate_vs_load.png (x = rate scale, one line
  per policy, the default in bold black), and each scale's own plots as scale-X-*.png.

trace format: JSONL, one request per line (Mooncake / NVIDIA Dynamo):
  {{"timestamp": 1532, "input_length": 4310, "output_length": 212, "hash_ids": [0, 1, 2]}}
  timestamp in ms; one hash id per --trace-block-size prompt tokens; equal ids = equal content
  and prefix. An optional "adapter" names a LoRA fine-tune. Generate one with
  `python -m bench.workloads --help`.

examples:
  python -m bench.workloads rag --requests 2000 --rate 20 --out rag.jsonl
  fleetgate simulate --trace rag.jsonl --replicas 8
  fleetgate simulate --trace rag.jsonl --policies round-robin,expected-ttft --rate-scale 2 \\
      --json > results.json
  fleetgate simulate --trace rag.jsonl --rate-scale 0.5,1,2,3,4 --plot sweep/   # knee plots
  fleetgate simulate --trace chat.jsonl --adapters zipf:40 --plot plots/
  fleetgate simulate --trace rag.jsonl --stats-interval-ms 1000   # stale engine gauges

default policies: {policies}
"""


def rate_scales(text: str) -> tuple[float, ...]:
    """``--rate-scale``: one positive number or a comma list of them (each listed once)."""
    scales = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {item.strip()!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"each scale must be a positive number (got {item})")
        if any(f"{value:g}" == f"{s:g}" for s in scales):  # as the tables and PNGs name them
            raise argparse.ArgumentTypeError(f"scale {value:g} is listed twice")
        scales.append(value)
    return tuple(scales)


def class_mix(text: str) -> ClassMix:
    """``--classes``: ``CLASS=SHARE`` pairs, comma-separated, summing to 1."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty: give CLASS=SHARE pairs, e.g. critical=0.2,standard=0.5,sheddable=0.3"
        )
    try:
        return parse_class_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fleetgate simulate``."""
    parser.epilog = EPILOG.format(policies=default_policies())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--trace", required=True, metavar="FILE", help="JSONL trace to replay")
    parser.add_argument(
        "--trace-block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="N",
        help=f"prompt tokens per hash id in the trace (default: {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        metavar="N",
        help="fleet size (default: 8, or a mixed --profile's counts added up)",
    )
    parser.add_argument(
        "--profile",
        default="h100-llama3-8b",
        metavar="NAME|FILE.yaml|NAME:N,NAME:N",
        help="engine preset from replica/sim/profiles/presets.yaml (default: h100-llama3-8b; "
        "also h200-llama3-8b, a100-llama3-8b, l4-llama3-8b-fp8, h100-llama3-70b-tp4, …), "
        "or a profile YAML file from `fleetgate sim calibrate`; a mixed fleet as "
        "NAME:COUNT,NAME:COUNT (e.g. h100-llama3-8b:4,a100-llama3-8b:4: each profile's "
        "replicas are a pool of their own)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        metavar="A,B,…",
        help="comma-separated routing policies to compare: built-in profiles, and with --config "
        "the profiles its file defines (default: all built-in but random, and every profile "
        "the --config file defines)",
    )
    parser.add_argument(
        "--config",
        metavar="POLICY.yaml",
        help="a routing-policy file (as `fleetgate serve --config` takes): its `profiles:` "
        "can be replayed by name, with their plugins' parameters, to rehearse a policy before "
        "shipping it; its routes, tenants and flow_control are not read (set SLOs and flow "
        "control with the flags below)",
    )
    parser.add_argument(
        "--rate-scale",
        type=rate_scales,
        default=(1.0,),
        metavar="X[,Y,…]",
        help="multiply the trace's request rate by X (timestamps divided by X; default: 1); a "
        "comma list (0.5,1,2,3,4) runs every policy at each scale: a load sweep",
    )
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="replay only the first N requests"
    )
    parser.add_argument(
        "--slo-ttft-ms",
        type=positive_float,
        default=2000.0,
        metavar="MS",
        help="TTFT SLO for goodput (default: 2000)",
    )
    parser.add_argument(
        "--slo-tpot-ms",
        type=positive_float,
        default=50.0,
        metavar="MS",
        help="time-per-output-token SLO for goodput (default: 50)",
    )
    parser.add_argument(
        "--adapters",
        metavar="SPEC",
        help="give requests without a trace 'adapter' a LoRA adapter: uniform:N, zipf:N[:S] or "
        "NAME=WEIGHT,… ('base' = no adapter); assigned by first block, so conversations keep "
        "theirs",
    )
    parser.add_argument(
        "--stats-interval-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="how often routing sees fresh engine gauges (running, waiting, KV usage); in-flight "
        "counts are always fresh (default: 0 = every decision)",
    )
    parser.add_argument(
        "--classes",
        type=class_mix,
        metavar="MIX",
        help="request classes by conversation, e.g. critical=0.2,standard=0.5,sheddable=0.3 "
        "(default: every request standard); JSON rows gain goodput_by_class. Flow control "
        "judges by the policy's TTFT estimate: policies that give none (round-robin, "
        "least-loaded, power-of-two, consistent-hash, cache-aware) show 'on (no estimate)' "
        "and admit everything",
    )
    parser.add_argument(
        "--flow-control",
        choices=("on", "off"),
        help="the gateway's flow control (priority queue, SLO-aware shedding; "
        "docs/flow-control.md) in front of routing (default: on with --classes, else off)",
    )
    parser.add_argument(
        "--protect-critical-decodes",
        action="store_true",
        help="flow control's flow_control.protect_critical_decodes (off by default): while "
        "decodes miss their TPOT and any replica is full, hold a standard or sheddable request "
        "whose prefill would push a critical decode on its replica past its TPOT SLO; implies "
        "--flow-control on (docs/flow-control.md, Protected critical decodes)",
    )
    parser.add_argument(
        "--no-steer-critical",
        dest="steer_critical",
        action="store_false",
        help="flow control leaves a critical request on the replica routing chose even when "
        "its decodes run too slow for the TPOT SLO (flow_control.steer_critical: false; "
        "docs/flow-control.md, Critical steering)",
    )
    parser.add_argument(
        "--no-steer-when-calm",
        dest="steer_when_calm",
        action="store_false",
        help="flow control holds a standard or sheddable request routed to a replica decoding "
        "too slowly, with most of the fleet full, even while the fleet is calm "
        "(flow_control.steer_when_calm: false; docs/flow-control.md, Calm steering)",
    )
    parser.add_argument(
        "--no-hold-for-backlog",
        dest="hold_for_backlog",
        action="store_false",
        help="flow control releases a queued request whenever any replica has room, even onto "
        "a replica where requests already wait (flow_control.hold_for_backlog: false; "
        "docs/flow-control.md, Releasing the queue)",
    )
    parser.add_argument(
        "--arrival-spread-ms",
        type=non_negative_int,
        default=0,
        metavar="MS",
        help="move each arrival later by a uniform draw from [0, MS) ms, seeded by --seed: for "
        "traces whose timestamps are coarse (Mooncake's conversation trace stamps arrivals in "
        "3-second buckets: 3000), so that a bucket's requests do not all arrive at once "
        "(default: 0, as recorded)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        metavar="N",
        help="replay the policies (and rate scales) in N worker processes: same results, about "
        "N times sooner on N free cores (default: 1)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument(
        "--plot",
        metavar="DIR",
        help="write TTFT CDF and hit-rate/goodput PNGs; with several rate scales, those per scale "
        "and goodput, p95 TTFT and hit rate against load",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: shown on a TTY)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the simulation (or the load sweep) and print the tables (or JSON)."""
    from planning.simulator.report import render_json
    from routing.policies.registry import BUILTIN_PROFILES

    file_profiles: tuple[str, ...] = ()
    if args.config:
        try:
            file_profiles = policy_file_profiles(args.config)
        except PolicyFileError as exc:
            return _fail(str(exc))
    known = [*BUILTIN_PROFILES, *file_profiles]
    names = args.policies if args.policies is not None else default_policies()
    if args.policies is None and file_profiles:
        names += "," + ",".join(file_profiles)
    policies = [p.strip() for p in names.split(",") if p.strip()]
    unknown = [p for p in policies if p not in known]
    if unknown or not policies:
        hint = "" if args.config else " (a profile of a policy file: add --config FILE)"
        return _fail(
            f"unknown policy {unknown[0] if unknown else '(none)'}; choose from: "
            + ", ".join(known) + hint
        )
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:
        return _fail(f"--policies names {twice[0]} twice: each policy runs once")
    if args.stats_interval_ms < 0:
        return _fail(f"--stats-interval-ms must be >= 0 (got {args.stats_interval_ms})")
    try:
        mix = parse_profile_mix(args.profile, args.replicas or 8)
    except ValueError as exc:
        return _fail(str(exc))
    counted = sum(count for _, count in mix)
    if args.replicas is None:
        args.replicas = counted
    elif counted != args.replicas:
        return _fail(
            f"--profile {args.profile} makes {counted} replicas, --replicas {args.replicas}: "
            "drop --replicas, or make the counts add up to it"
        )
    if args.flow_control == "off":
        for flag, given in (
            ("--protect-critical-decodes", args.protect_critical_decodes),
            ("--no-steer-critical", not args.steer_critical),
            ("--no-steer-when-calm", not args.steer_when_calm),
            ("--no-hold-for-backlog", not args.hold_for_backlog),
        ):
            if given:
                return _fail(f"{flag} is a flow-control setting: drop --flow-control off")
    # Before the (possibly long) simulation, so a missing extra costs no work.
    if args.plot and (problem := missing_extra("matplotlib", PLAN, "--plot")):
        return _fail(problem)
    if args.plot:
        try:
            Path(args.plot).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _fail(f"cannot write plots to {args.plot}: {exc.strerror or exc}")
    try:
        records = read_trace(args.trace, args.trace_block_size, args.limit)
    except OSError as exc:
        return _fail(f"cannot read {args.trace}: {exc.strerror}")
    except TraceFormatError as exc:
        return _fail(str(exc))
    if not records:
        return _fail(f"{args.trace} holds no requests")
    for note in trace_notes(args.trace, records[: args.limit], args.arrival_spread_ms):
        print(note, file=sys.stderr)
    if problem := _too_slow_a_scale(records[: args.limit], args.rate_scale):
        return _fail(problem)
    if problem := _too_big_a_fleet(args, len(args.rate_scale) * len(policies)):
        return _fail(problem)
    if args.classes is not None:
        note = _class_split_note(records[: args.limit], args.classes, args.seed)
        if note:
            print(note, file=sys.stderr)
    try:
        factories = file_profile_factories(
            args.config, [p for p in policies if p in file_profiles]
        )
        points = _sweep(args, records, policies, factories)
    except ValueError as exc:
        return _fail(str(exc))
    except BrokenProcessPool:
        return _fail(
            "a worker process died mid-replay (killed: out of memory?); rerun with fewer "
            f"--jobs (now {args.jobs}) or fewer --replicas"
        )
    print(render_json(points) if args.json else _tables(args, points))
    _warn_refused(points)
    if _nothing_served(points):
        return _fail(
            "the engines refused every request (the warning above says why), so nothing was "
            "measured: for prompts over the model's context, replay with a --profile whose "
            "max_model_len holds them, or leave those lines out of the trace"
        )
    if args.plot:
        for path in _plots(args, points):
            print(f"wrote {path}", file=sys.stderr)
    return 0


#: The latest arrival a replay keeps exact: past it (about 32 years) a float's step passes a
#: microsecond, and engine steps of milliseconds round away (TTFTs of 0 ms).
MAX_ARRIVAL_S = 1e9


def _too_slow_a_scale(records: Sequence[TraceRecord], scales: Sequence[float]) -> str | None:
    """Why the slowest ``--rate-scale`` stretches the trace past what a replay keeps exact."""
    span_s = (records[-1].timestamp - records[0].timestamp) / 1000.0 if records else 0.0
    slowest = min(scales)
    if span_s <= 0 or span_s / slowest <= MAX_ARRIVAL_S:
        return None
    return (
        f"--rate-scale {slowest:g} stretches this trace's {span_s:,.0f} s to {span_s / slowest:.3g}"
        f" s, past what the replay's clock keeps exact ({MAX_ARRIVAL_S:.0e} s): use a scale of "
        f"at least {span_s / MAX_ARRIVAL_S:.2g}"
    )


#: Memory a simulated engine takes per KV block (its block table and prefix-cache entries),
#: measured on h100-llama3-8b (about 4 MB an engine), with headroom.
BYTES_PER_BLOCK = 160


def _too_big_a_fleet(args: argparse.Namespace, runs: int) -> str | None:
    """Why the fleet asked for would not fit in this machine's free memory (None: it fits, or
    the free memory is unknown). Each worker process builds its own fleet, and there are no
    more workers than ``runs`` (rate scales x policies)."""
    from planning.simulator import SimulationConfig
    from planning.simulator.api import engine_configs_for

    try:
        configs = engine_configs_for(
            SimulationConfig(replicas=args.replicas, profile=args.profile)
        )
    except ValueError:
        return None  # the replay says what is wrong with the profile, naming it
    workers = max(1, min(args.jobs, runs))
    need = sum(c.num_gpu_blocks for c in configs) * BYTES_PER_BLOCK * workers
    free = _available_memory_bytes()
    if free is None or need <= free:
        return None
    return (
        f"--replicas {args.replicas} would take about {need / 2**30:.1f} GiB (each simulated "
        f"engine keeps its KV blocks' tables), {free / 2**30:.1f} GiB is free here: simulate "
        "fewer replicas (a fleet's behaviour per replica shows at 8-64), or fewer --jobs"
    )


def _available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _class_split_note(records: Sequence[TraceRecord], mix: ClassMix, seed: int) -> str | None:
    """A note when the classes drawn per conversation split the requests far from ``mix``: a
    small trace holds few conversations (fewer than ``COMMON_MIN`` requests: every request
    shares the trace's first hash id, and all of them make one)."""
    from collections import Counter

    from planning.simulator.flow import assign_classes, conversation_keys

    drawn = Counter(assign_classes(records, mix, seed))
    total = len(records)
    off = max(abs(drawn.get(c, 0) / total - share) for c, share in mix.shares.items())
    if off <= 0.1:
        return None
    conversations = len(set(conversation_keys(records)))
    split = ", ".join(f"{c.value}={drawn.get(c, 0) / total:.0%}" for c in mix.shares)
    return (
        f"note: --classes {mix.spec()} draws a class per conversation; this trace's "
        f"{total} requests hold {conversations} conversation(s), so its requests split {split}"
        " (docs/simulate.md, Request classes)"
    )


def _fail(message: str) -> int:
    print(f"fleetgate simulate: {message}", file=sys.stderr)
    return 2


def _sweep(
    args: argparse.Namespace,
    records: Sequence[TraceRecord],
    policies: list[str],
    factories: Mapping[str, Callable[[], Profile]],
) -> list[SweepPoint]:
    """Every policy at every ``--rate-scale`` (``factories``: those of a ``--config`` file's
    profiles); raises ValueError on a bad setting."""
    from planning.simulator import SimulationConfig, parse_adapter_spec
    from planning.simulator.api import simulate_sweep
    from routing.flow_control import FlowControlSettings

    adapters = parse_adapter_spec(args.adapters) if args.adapters else None
    classes = args.classes
    flow_on = (
        args.flow_control == "on"
        or args.protect_critical_decodes
        or (args.flow_control is None and classes is not None)
    )
    config = SimulationConfig(
        replicas=args.replicas,
        profile=args.profile,
        trace_block_size=args.trace_block_size,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        seed=args.seed,
        stats_interval_s=args.stats_interval_ms / 1000.0,
        classes=classes,
        flow_control=FlowControlSettings(
            protect_critical_decodes=args.protect_critical_decodes,
            steer_critical=args.steer_critical,
            steer_when_calm=args.steer_when_calm,
            hold_for_backlog=args.hold_for_backlog,
        )
        if flow_on
        else None,
    )
    replayed = min(len(records), args.limit or len(records))
    if args.arrival_spread_ms:
        # The first --limit requests as recorded, then spread: the spread must not change
        # which requests are replayed.
        records = spread_arrivals(records[:replayed], args.arrival_spread_ms, args.seed)
    # A bar is worth drawing only on a terminal, and only when the whole sweep takes a while.
    progress = (
        not args.no_progress
        and sys.stderr.isatty()
        and replayed * len(args.rate_scale) >= 500
        and progress_available(PLAN, "fleetgate simulate")
    )
    return simulate_sweep(
        records,
        args.rate_scale,
        policies,
        config,
        limit=args.limit,
        adapters=adapters,
        progress=progress,
        jobs=args.jobs,
        profile_factories=factories,
    )


def _nothing_served(points: list[SweepPoint]) -> bool:
    """True when the engines refused every request of every run."""
    runs = [run for point in points for run in point.report.runs.values()]
    return bool(runs) and all(run.rejected and not run.outcomes for run in runs)


def _warn_refused(points: list[SweepPoint]) -> None:
    """One line per rate scale: how many requests each policy's engines refused, and why."""
    for point in points:
        runs = point.report.runs.values()
        refused = {run.policy: run.rejected for run in runs if run.rejected}
        if refused:
            where = f" at rate scale {point.rate_scale:g}" if len(points) > 1 else ""
            example = next((r.rejection_example for r in runs if r.rejection_example), None)
            why = f"; the first: {example}" if example else ""
            print(
                f"warning: engines refused requests{where} (left out of every figure): "
                f"{refused}{why}",
                file=sys.stderr,
            )


def _tables(args: argparse.Namespace, points: list[SweepPoint]) -> str:
    """One table per rate scale, each titled with the trace, its load and the fleet."""
    from planning.simulator.report import render_table

    blocks = []
    for point in points:
        scale = f" (rate scale {point.rate_scale:g})" if len(points) > 1 else ""
        title = (
            f"{args.trace}: {point.requests} requests at {_rate(point.rate)}{scale} on "
            f"{_fleet(args)}; SLOs TTFT {args.slo_ttft_ms:g} ms, "
            f"TPOT {args.slo_tpot_ms:g} ms"
        )
        blocks.append(render_table(point.report, title))
    return "\n\n".join(blocks)


def _fleet(args: argparse.Namespace) -> str:
    """``8 x h100-llama3-8b``, or a mixed fleet's ``4 x h100-llama3-8b + 4 x a100-llama3-8b``."""
    return " + ".join(f"{count} x {name}" for name, count in parse_profile_mix(
        args.profile, args.replicas
    ))


def _rate(rate: float) -> str:
    """The trace's arrival rate; a trace whose requests share one timestamp has none."""
    return f"{rate:.2f} req/s" if math.isfinite(rate) else "one instant (all at once)"


def _plots(args: argparse.Namespace, points: list[SweepPoint]) -> list[Path]:
    """One run's plots; for a sweep, each scale's (prefixed ``scale-X-``) and the load plots."""
    from planning.simulator.report import write_load_plots, write_plots

    trace = Path(args.trace).name
    if len(points) == 1:
        return write_plots(points[0].report, args.plot, title=trace)
    written = []
    for point in points:
        written += write_plots(
            point.report, args.plot, prefix=f"scale-{point.rate_scale:g}-",
            title=f"{trace} at {point.rate_scale:g}x",
        )
    written += write_load_plots(
        points, args.plot, title=Path(args.trace).name, slo_ttft_ms=args.slo_ttft_ms
    )
    return written
