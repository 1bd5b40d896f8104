"""``fleetgate simulate``: replay a trace through routing policies in virtual time.

The work is done by ``planning/simulator``; this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import sys

from bench.workloads.trace import DEFAULT_BLOCK_SIZE, TraceFormatError, read_trace

DEFAULT_POLICIES = "round-robin,least-loaded,power-of-two,consistent-hash,cache-aware,expected-ttft"

EPILOG = f"""\
what it does:
  Each policy replays the trace on a fresh fleet of --replicas simulated vLLM engines
  (replica/sim: roofline step times, continuous batching, paged prefix cache, LoRA slots),
  routed by the real routing/ code: the same RoutingEngine and policies as the gateway, a
  block index fed by the engines' KV events and by speculative inserts after each decision,
  in-flight counts per replica, engine gauges polled every --stats-interval-ms.
  Time is virtual: a 10-minute trace takes seconds to a minute of CPU.

output (one row per policy):
  hit rate        cached prompt tokens / prompt tokens, as the engines counted them
  TTFT, TPOT      p50/p95/p99 time to first token, p50/p95 time per output token (ms)
  queue p95       arrival to first scheduling by the engine (ms)
  goodput         share of requests meeting both --slo-ttft-ms and --slo-tpot-ms
  out tok/s       output tokens / makespan;  $/1M out: fleet price x makespan / output tokens
  imbalance       max / mean requests per replica;  preempt: engine preemptions
  ceilings        unbounded: one replica, infinite cache (the trace's own reuse);
                  pooled: one LRU cache as large as the whole fleet's KV capacity
                  (what a perfect router without duplication could reach)

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
  fleetgate simulate --trace chat.jsonl --adapters zipf:40 --plot plots/
  fleetgate simulate --trace rag.jsonl --stats-interval-ms 1000   # stale engine gauges

default policies: {DEFAULT_POLICIES}
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {value})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fleetgate simulate``."""
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--trace", required=True, metavar="FILE", help="JSONL trace to replay")
    parser.add_argument(
        "--trace-block-size",
        type=_positive_int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="N",
        help=f"prompt tokens per hash id in the trace (default: {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--replicas", type=_positive_int, default=8, metavar="N", help="fleet size (default: 8)"
    )
    parser.add_argument(
        "--profile",
        default="h100-llama3-8b",
        metavar="NAME",
        help="engine preset from replica/sim/profiles/presets.yaml (default: h100-llama3-8b; "
        "also h200-llama3-8b, a100-llama3-8b, l4-llama3-8b-fp8, h100-llama3-70b-tp4, …)",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        metavar="A,B,…",
        help="comma-separated built-in routing policies to compare (default: all but random)",
    )
    parser.add_argument(
        "--rate-scale",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="multiply the trace's request rate by X (timestamps divided by X; default: 1)",
    )
    parser.add_argument(
        "--limit", type=_positive_int, metavar="N", help="replay only the first N requests"
    )
    parser.add_argument(
        "--slo-ttft-ms",
        type=_positive_float,
        default=2000.0,
        metavar="MS",
        help="TTFT SLO for goodput (default: 2000)",
    )
    parser.add_argument(
        "--slo-tpot-ms",
        type=_positive_float,
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
        type=float,
        default=0.0,
        metavar="MS",
        help="how often routing sees fresh engine gauges (running, waiting, KV usage); in-flight "
        "counts are always fresh (default: 0 = every decision)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--plot", metavar="DIR", help="write TTFT CDF and hit-rate/goodput PNGs")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: shown on a TTY)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the simulation and print the table (or JSON)."""
    from planning.simulator import (
        SimulationConfig,
        parse_adapter_spec,
        prepare_requests,
        simulate,
    )
    from planning.simulator.report import render_json, render_table, write_plots
    from routing.policies.registry import BUILTIN_PROFILES

    def fail(message: str) -> int:
        print(f"fleetgate simulate: {message}", file=sys.stderr)
        return 2

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in BUILTIN_PROFILES]
    if unknown or not policies:
        return fail(
            f"unknown policy {unknown[0] if unknown else '(none)'}; choose from: "
            + ", ".join(BUILTIN_PROFILES)
        )
    if args.stats_interval_ms < 0:
        return fail(f"--stats-interval-ms must be >= 0 (got {args.stats_interval_ms})")
    try:
        records = read_trace(args.trace, args.trace_block_size)
    except OSError as exc:
        return fail(f"cannot read {args.trace}: {exc.strerror}")
    except TraceFormatError as exc:
        return fail(str(exc))
    if not records:
        return fail(f"{args.trace} holds no requests")
    try:
        adapters = parse_adapter_spec(args.adapters) if args.adapters else None
        config = SimulationConfig(
            replicas=args.replicas,
            profile=args.profile,
            trace_block_size=args.trace_block_size,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            seed=args.seed,
            stats_interval_s=args.stats_interval_ms / 1000.0,
        )
        requests = prepare_requests(
            records, rate_scale=args.rate_scale, limit=args.limit, adapters=adapters, seed=args.seed
        )
        progress = not args.no_progress and sys.stderr.isatty() and len(requests) >= 500
        report = simulate(requests, policies, config, progress=progress)
    except ValueError as exc:
        return fail(str(exc))
    if args.json:
        print(render_json(report))
    else:
        span_s = requests[-1].arrival_s - requests[0].arrival_s
        rate = len(requests) / span_s if span_s > 0 else float("nan")
        title = (
            f"{args.trace}: {len(requests)} requests at {rate:.2f} req/s on {args.replicas} x "
            f"{args.profile}; SLOs TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms"
        )
        print(render_table(report, title))
    rejected = {name: run.rejected for name, run in report.runs.items() if run.rejected}
    if rejected:
        print(f"warning: engines refused requests (too long?): {rejected}", file=sys.stderr)
    if args.plot:
        for path in write_plots(report, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0
