"""``fleetgate bench``: benchmarks against live endpoints. One tool so far:

- ``fleetgate bench replay``: replay a trace against an OpenAI-compatible endpoint
  (``bench/replay``).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from datetime import UTC, datetime

from fleetgate.commands._args import (
    HelpFormatter,
    http_url,
    non_negative_float,
    positive_float,
    positive_int,
)
from fleetgate.extras import BENCH, progress_available
from traces.format import DEFAULT_BLOCK_SIZE

REPLAY_EPILOG = """\
what it sends:
  One streamed /v1/completions request per trace line, at the line's timestamp multiplied by
  --time-scale, with at most --concurrency in flight. The prompt is synthesised from the
  line's hash_ids: each id becomes --trace-block-size common English words, chosen
  deterministically from the id, so equal ids give equal text and equal token prefixes. On
  BPE/SentencePiece tokenizers such words are one token each, so a block is about
  --trace-block-size tokens (exactly, on fleetgate's simulated replicas). max_tokens is the
  line's output_length, with ignore_eos so the engine generates all of it. A line's "adapter"
  is sent as the model name (vLLM's LoRA convention).

what it measures:
  client side: TTFT, inter-token latency (ITL), end-to-end latency percentiles, throughput,
  cached tokens from usage.prompt_tokens_details (if the server reports them);
  server side (--metrics-url, repeatable): deltas of vllm:prefix_cache_hits_total and
  vllm:prefix_cache_queries_total over the replay, per replica and in total.

examples:
  python -m bench.workloads rag --requests 500 --rate 5 --out rag.jsonl
  fleetgate bench replay --trace rag.jsonl --url http://localhost:8080 --model llama-3-8b \\
      --api-key $KEY --metrics-url http://vllm-0:8000/metrics --metrics-url http://vllm-1:8000/metrics
  fleetgate bench replay --trace rag.jsonl --url http://localhost:8080 --model m --time-scale 0.5 \\
      --json > result.json        # twice the trace's rate
"""


def _add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = REPLAY_EPILOG
    parser.formatter_class = HelpFormatter
    parser.add_argument("--trace", required=True, metavar="FILE", help="JSONL trace to replay")
    parser.add_argument(
        "--url",
        required=True,
        type=http_url("the endpoint's URL"),
        help="base URL of the endpoint (gateway or vLLM), with or without /v1",
    )
    parser.add_argument("--model", required=True, help="model name for lines without adapter")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--trace-block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="N",
        help=f"prompt tokens per hash id in the trace (default: {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--time-scale",
        type=non_negative_float,
        default=1.0,
        metavar="X",
        help="multiply trace timestamps by X: 0.5 = twice as fast, 0 = all at once (default: 1)",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=64,
        metavar="N",
        help="most requests in flight at once (default: 64)",
    )
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="replay only the first N lines"
    )
    parser.add_argument(
        "--metrics-url",
        type=http_url("a /metrics URL"),
        action="append",
        default=[],
        metavar="URL",
        help="a replica's Prometheus /metrics URL (repeat for each replica)",
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let the model stop early instead of generating output_length tokens",
    )
    parser.add_argument(
        "--timeout-s", type=positive_float, default=600.0, help="per-request timeout (default: 600)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt-text seed (default: 0)")
    parser.add_argument(
        "--max-error-rate",
        type=_error_rate,
        metavar="R",
        help="exit 1 when more than this share of requests failed, e.g. 0.01 for CI "
        "(default: exit 1 only when none succeeded)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: shown on a TTY)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fleetgate bench TOOL [options]``."""
    parser.formatter_class = HelpFormatter
    parser.epilog = "Run `fleetgate bench replay --help` for the replay options."
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    replay = tools.add_parser(
        "replay",
        help="replay a trace against an OpenAI-compatible endpoint",
        description="Replay a JSONL trace against an OpenAI-compatible endpoint and measure it.",
    )
    _add_replay_arguments(replay)


def _run_replay(args: argparse.Namespace) -> int:
    from bench.replay import EndpointProblem, ReplayConfig, replay
    from bench.replay.summary import render_table, summarize
    from routing.redis_clients import redacted
    from traces.format import TraceFormatError, read_trace

    def fail(message: str) -> int:
        print(f"fleetgate bench replay: {message}", file=sys.stderr)
        return 2

    try:
        config = ReplayConfig(
            url=args.url,
            model=args.model,
            api_key=args.api_key,
            trace_block_size=args.trace_block_size,
            time_scale=args.time_scale,
            concurrency=args.concurrency,
            limit=args.limit,
            metrics_urls=tuple(args.metrics_url),
            ignore_eos=not args.no_ignore_eos,
            request_timeout_s=args.timeout_s,
            seed=args.seed,
        )
        # Only the lines replayed: a bad line past --limit does not stop the replay.
        records = read_trace(args.trace, args.trace_block_size, args.limit)
    except OSError as exc:
        return fail(f"cannot read {args.trace}: {exc.strerror}")
    except (TraceFormatError, ValueError) as exc:
        return fail(str(exc))
    if not records:
        return fail(f"{args.trace} holds no requests")
    from traces.notes import trace_notes

    for note in trace_notes(args.trace, records):
        print(note, file=sys.stderr)
    progress = (
        not args.no_progress
        and not args.json
        and sys.stderr.isatty()
        and progress_available(BENCH, "fleetgate bench replay")
    )
    started_utc = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        result = replay(config, records, progress=progress)
    except EndpointProblem as exc:
        return fail(str(exc))
    run = {
        "trace": args.trace,
        "url": redacted(args.url),  # a saved result keeps no password
        "model": args.model,
        "time_scale": args.time_scale,
        "concurrency": args.concurrency,
        "limit": args.limit,
        "trace_block_size": args.trace_block_size,
        "ignore_eos": not args.no_ignore_eos,
        "seed": args.seed,
        "timeout_s": args.timeout_s,
        "metrics_urls": [redacted(url) for url in args.metrics_url],
        "started_utc": started_utc,
    }
    summary = summarize(result, run)
    if result.interrupted:  # a second Ctrl-C while this prints would lose what finished
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(json.dumps(summary, indent=2) if args.json else render_table(summary))
    if result.interrupted:  # what finished was reported; the exit says it was cut short
        return 143 if result.interrupted == "SIGTERM" else 130
    failed = len(result.results) - int(summary["ok"])  # type: ignore[call-overload]
    if args.max_error_rate is not None and failed > args.max_error_rate * len(result.results):
        print(
            f"fleetgate bench replay: {failed} of {len(result.results)} requests failed, more "
            f"than --max-error-rate {args.max_error_rate:g}",
            file=sys.stderr,
        )
        return 1
    return 0 if summary["ok"] else 1


def _error_rate(text: str) -> float:
    """A share of requests, 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share of requests from 0 to 1 (got {text!r})")
    return value


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen tool."""
    if args.tool == "replay":
        return _run_replay(args)
    raise AssertionError(f"unknown tool {args.tool!r}")  # argparse restricts the choice
