"""``fleetgate sim calibrate``: fit a profile YAML to a live vLLM engine.

Examples::

    # measure a running engine (~1 minute), print the fit's residuals, write the profile;
    # bursts of concurrent requests measure the API server's own work per request and token
    fleetgate sim calibrate --engine http://127.0.0.1:8000 --output cpu-tiny.yaml \\
        --max-num-seqs 256 --max-num-batched-tokens 2048

    # with LoRA: also time loading an adapter (storage -> host -> slot); the path as the
    # engine sees it, readable here to size the adapter
    fleetgate sim calibrate --engine http://127.0.0.1:8000 --output cpu-tiny.yaml \\
        --adapter sql=/models/sql-lora --max-loras 2 --max-cpu-loras 4

    # then use it wherever a preset goes
    fleetgate sim --profile cpu-tiny.yaml
    fleetgate simulate --trace t.jsonl --profile cpu-tiny.yaml
    fleetgate plan capacity --profile cpu-tiny.yaml ...
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from fleetgate.commands._args import http_url
from planning.calibrate import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    CalibrationPlan,
    EngineLimits,
    ProbeError,
    calibrate,
    write_profile,
)
from planning.calibrate.adapters import parse_adapter
from planning.output_path import output_path_problem
from replica.sim.profiles import load_preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fleetgate sim calibrate`` (on the ``fleetgate sim`` parser)."""
    group = parser.add_argument_group("calibrate (fleetgate sim calibrate --engine URL)")
    group.add_argument(
        "--engine", type=http_url("the engine's URL"),
        help="the engine's OpenAI base URL, e.g. http://HOST:8000",
    )
    group.add_argument(
        "--metrics-url", type=http_url("a /metrics URL"),
        help="its Prometheus metrics (default: ENGINE/metrics)",
    )
    group.add_argument(
        "--output", type=Path, default=Path("profile.yaml"),
        help="where to write the profile YAML (default: profile.yaml)",
    )
    group.add_argument(
        "--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
        help="the engine's --max-num-seqs (not published in its metrics; default vLLM's 256); "
        "calibration also decodes a batch of exactly this many where its prompts fit one step",
    )
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="the engine's --max-num-batched-tokens (default 2048)",
    )
    group.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH",
        help="also time loading this LoRA adapter (repeatable): its load call (storage to host "
        "to a slot) and its first request once other adapters pushed it out of its slot. PATH "
        "as the engine sees it, readable here (its size); the engine needs --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True. Writes lora_storage_gbps, lora_h2d_gbps and "
        "adapter_default_size_mb",
    )
    group.add_argument(
        "--adapter-repeats", type=int, default=3, metavar="N",
        help="rounds per adapter, combined by their median (default 3)",
    )
    # --max-loras is `fleetgate sim`'s own option (the same flag of vLLM); calibrate reads it
    # as the engine's: how many more adapters push one out of its slot.
    group.add_argument(
        "--max-cpu-loras", type=int, default=None,
        help="with --adapter: the engine's --max-cpu-loras, and --max-loras its --max-loras "
        "(default: the base profile's); the slot stage is measured only where the host cache "
        "holds more adapters than the slots",
    )
    group.add_argument(
        "--base-profile", default="tiny",
        help="preset whose hardware and model geometry the profile keeps (default: tiny)",
    )
    group.add_argument(
        "--quick", action="store_true",
        help="a shorter workload (fewer lengths, repeats and batch sizes)",
    )


QUICK_PLAN = CalibrationPlan(
    prefill_lengths=(64, 512, 1536),
    prefill_repeats=3,
    decode_batches=(1, 4, 8),
    decode_contexts=(32, 512),
    decode_tokens=12,
    decode_repeats=2,
    warmup_requests=1,
    prefill_idle_s=0.05,
    burst_sizes=(8,),
    burst_tokens=(4, 12),
    burst_repeats=1,
)


def _base_profile_problem(name: str) -> str | None:
    try:
        load_preset(name)
    except (ValueError, KeyError, OSError) as exc:
        return f"--base-profile: {exc}"
    return None


def _output_problem(path: Path) -> str | None:
    if path.is_dir():
        return f"--output {path} is a folder; name a file in it, e.g. {path / 'profile.yaml'}"
    problem = output_path_problem(path)
    return None if problem is None else f"--output {path}: {problem}"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fleetgate sim calibrate``."""
    if not args.engine:
        print("fleetgate sim calibrate: --engine URL is required", file=sys.stderr)
        return 2
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            print(f"fleetgate sim calibrate: {flag} must be >= 1", file=sys.stderr)
            return 2
    for name in ("max_loras", "max_cpu_loras"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            flag = "--" + name.replace("_", "-")
            print(f"fleetgate sim calibrate: {flag} must be >= 0", file=sys.stderr)
            return 2
    if args.adapter_repeats < 1:
        print("fleetgate sim calibrate: --adapter-repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        adapters = tuple(parse_adapter(text) for text in args.adapter)
    except ValueError as exc:
        print(f"fleetgate sim calibrate: {exc}", file=sys.stderr)
        return 2
    # Checked before measuring: a typo found after minutes against a real engine threw the
    # whole measurement away (the CLI review).
    problem = _base_profile_problem(args.base_profile) or _output_problem(args.output)
    if problem:
        print(f"fleetgate sim calibrate: {problem}", file=sys.stderr)
        return 2
    limits = EngineLimits(
        args.max_num_seqs, args.max_num_batched_tokens,
        args.max_loras, args.max_cpu_loras,
    )
    plan = QUICK_PLAN if args.quick else CalibrationPlan()
    try:
        result = asyncio.run(
            calibrate(
                args.engine, args.metrics_url, plan, limits, args.base_profile,
                progress=lambda line: print(f"  {line}", flush=True),
                adapters=adapters, adapter_repeats=args.adapter_repeats,
            )
        )
        write_profile(result, args.output)
    except (ProbeError, ValueError, OSError) as exc:
        print(f"fleetgate sim calibrate: {exc}", file=sys.stderr)
        return 1
    model = result.path.model
    print(result.fit.table())
    if result.path.residuals:
        print(result.path.table())
    if result.adapters is not None:
        print(result.adapters.table())
    print(
        f"fitted step time: base {model.base_s * 1e3:.2f} ms + "
        f"{model.prefill_token_s * 1e6:.2f} us/prefill token "
        f"({model.prefill_tokens_per_s():,.0f} tokens/s) + "
        f"{model.decode_seq_s * 1e3:.3f} ms/decoding sequence + "
        f"{model.context_token_s * 1e6:.3f} us/context token; "
        f"request overhead {model.request_overhead_s * 1e3:.2f} ms, of which work "
        f"{model.request_work_s * 1e3:.2f} ms per request + "
        f"{model.stream_token_s * 1e3:.3f} ms per streamed token (queued under concurrency)"
    )
    print(
        f"KV cache: {result.cache.num_gpu_blocks} blocks of {result.cache.block_size} tokens; "
        f"max_model_len {result.max_model_len}; measured in {result.elapsed_s:.0f} s"
    )
    print(f"wrote {args.output}")
    return 0
