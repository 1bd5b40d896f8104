"""``python -m bench.workloads SHAPE --requests N --rate R --arrival poisson|bursty --out FILE``."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from bench.workloads.arrivals import ARRIVALS, BurstParams
from bench.workloads.generators import generate
from bench.workloads.shapes import SHAPES
from traces.format import DEFAULT_BLOCK_SIZE, TraceRecord, write_trace

EPILOG = """\
trace format (one JSON object per line, as Mooncake traces / NVIDIA Dynamo):
  {"timestamp": 1532, "input_length": 4310, "output_length": 212, "hash_ids": [0, 1, 2, ...]}
  timestamp is ms since the start; hash_ids has one id per block_size prompt tokens, equal ids
  mean equal content and prefix. b2b-lora records add "adapter" (a fleetgate extension).

examples:
  # 2,000 RAG requests at 5 req/s, Poisson arrivals
  python -m bench.workloads rag --requests 2000 --rate 5 --arrival poisson --out rag.jsonl
  # the same prompts with a timestamp at the top: watch the prefix hit rate drop to zero
  python -m bench.workloads rag-cache-buster --requests 2000 --rate 5 --out buster.jsonl
  # bursts at 4x the mean rate, 20% of the time, cycles of ~60 s
  python -m bench.workloads multi-turn --requests 5000 --rate 10 --arrival bursty \\
      --burst-peak 4 --burst-on-fraction 0.2 --burst-cycle-s 60 --out chat.jsonl

The same arguments (including --seed) always produce the same file.
"""


def build_parser() -> argparse.ArgumentParser:
    """The CLI parser; shapes and arrival processes are listed in ``--help``."""
    shapes = "\n".join(f"  {name:<17} {shape.summary}" for name, shape in SHAPES.items())
    parser = argparse.ArgumentParser(
        prog="python -m bench.workloads",
        description=f"Generate a synthetic request trace.\n\nshapes:\n{shapes}",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shape", choices=list(SHAPES), metavar="SHAPE", help="workload shape")
    parser.add_argument("--requests", type=int, required=True, help="number of records")
    parser.add_argument("--rate", type=float, required=True, help="mean arrival rate, requests/s")
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="poisson",
        help="poisson: constant rate; bursty: on/off MMPP with the same mean (default: poisson)",
    )
    parser.add_argument("--out", required=True, help="output JSONL file ('-' for stdout)")
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"prompt tokens per hash id (default: {DEFAULT_BLOCK_SIZE}, as Mooncake traces)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    defaults = BurstParams()
    burst = parser.add_argument_group("bursty arrivals")
    burst.add_argument(
        "--burst-peak",
        type=float,
        default=defaults.peak,
        help=f"ON-state rate as a multiple of --rate (default: {defaults.peak:g})",
    )
    burst.add_argument(
        "--burst-on-fraction",
        type=float,
        default=defaults.on_fraction,
        help=f"share of time spent in bursts (default: {defaults.on_fraction:g})",
    )
    burst.add_argument(
        "--burst-cycle-s",
        type=float,
        default=defaults.cycle_s,
        help=f"mean seconds of one burst + quiet cycle (default: {defaults.cycle_s:g})",
    )
    return parser


def summarize(records: Sequence[TraceRecord]) -> str:
    """One line about a trace, for stderr after writing."""
    span_s = records[-1].timestamp / 1000 if records else 0.0
    rate = len(records) / span_s if span_s > 0 else float("nan")
    return (
        f"{len(records)} requests over {span_s:.1f} s ({rate:.2f} req/s), "
        f"median input {statistics.median(r.input_length for r in records):.0f} tokens, "
        f"median output {statistics.median(r.output_length for r in records):.0f} tokens"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.block_size < 1:
        parser.error(f"--block-size must be >= 1 (got {args.block_size})")
    try:
        burst = BurstParams(args.burst_peak, args.burst_on_fraction, args.burst_cycle_s)
        records = generate(
            args.shape, args.requests, args.rate, args.arrival, args.block_size, args.seed, burst
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.out == "-":
        write_trace(records, sys.stdout)
    else:
        try:
            write_trace(records, args.out)
        except OSError as exc:
            print(
                f"python -m bench.workloads: cannot write {args.out}: {exc.strerror}",
                file=sys.stderr,
            )
            return 1
        print(f"wrote {args.out}: {summarize(records)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
