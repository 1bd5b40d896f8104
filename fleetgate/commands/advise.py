"""``fleetgate advise``: per pool, the vLLM flags to change, by how much, and why.

The rules live in ``planning/advise/`` (pure); this module picks the source (a snapshot file, a
gateway, engines), lays ``--flags`` files and profile names over what the engines reported,
prints, and with ``--verify`` replays the traffic through the simulator with both flag sets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from fleetgate.commands._args import (
    HelpFormatter,
    http_url,
    positive_float,
    positive_int,
    promql_duration,
)
from planning import yamlio
from planning.advise import AdviceError, EngineFlags, PoolSnapshot, advise
from planning.advise.live import Target, gateway_targets, overlay_flags, parse_target, read_live
from planning.advise.render import to_json, to_text
from planning.advise.snapshot import load_flags, load_snapshot, to_mapping
from planning.triage.model import SourceError
from replica.sim.profiles import hardware_names, model_names

EPILOG = """\
what it checks, per pool (docs/advise.md has each rule and a worked example):
  --max-model-len           cut to max(p99 prompt+output x 1.25, longest seen, longest prompt +
                            requested max_tokens), block-aligned (vLLM refuses prompt +
                            max_tokens over it; without the gateway's budget histogram the row
                            warns that the cut may refuse long-output requests)
  --gpu-memory-utilization  back to 0.9 when lowered and KV is pinned
  --kv-cache-dtype          fp8 when KV is pinned (preemptions, or >= 90% while requests wait
                            or the queue grows) on a GPU with FP8: exactly 2x the blocks
  --quantization            fp8 weights when KV is still pinned with an FP8 cache (methods whose
                            weight width is unknown: not checked)
  --enable-prefix-caching   on (it costs nothing where it buys little)
  --enable-chunked-prefill  on (long prefills stop stalling decodes)
  --tensor-parallel-size    the smallest power of two that fits, at most the KV-head count
  --max-num-seqs            90% of the running level at which preemptions start (vLLM's
                            default: 1024 on 70 GiB+ GPUs other than A100, else 256; a running
                            level above an assumed default is reported, not cut from)
  --max-loras/--max-cpu-loras  the adapter working set, when adapters thrash
Each value says where it came from: measured, engine-reported, given (--flags, the snapshot),
or assumed default (vLLM's).

sources:
  --input FILE          a snapshot (YAML/JSON; `--save` writes one from a live fleet)
  --gateway URL         the gateway's /metrics (request lengths per pool, adapter activity)
                        and /admin/replicas (needs --admin-key or FLEETGATE_ADMIN_KEY), then
                        each replica's /metrics and /v1/models, --samples times
  --engine [POOL=]URL   engines directly, no gateway (repeatable; lengths from vLLM's own
                        histograms)
  --prometheus URL      PromQL over --window (default 10m); engine series grouped by
                        --pool-label (default pool); --max-model-len needs --flags there

examples:
  fleetgate advise --input fleet.yaml
  fleetgate advise --gateway http://gw:8000 --admin-key $KEY --samples 10 --interval 3
  fleetgate advise --engine chat=http://10.0.0.5:8000 --flags chat=chat-flags.yaml \\
      --hardware h100-sxm --model llama3-8b
  fleetgate advise --input fleet.yaml --verify --requests 2000 --json
"""

#: The longest wait between two scrapes (s): an hour; NaN and inf are no interval.
MAX_INTERVAL_S = 3600.0


def _profile_name(kind: str, names: Callable[[], list[str]]) -> Callable[[str], str]:
    """An argparse type for a ``kind`` profile's name: one that is not known was taken silently
    without ``--hardware`` and sized nothing (the CLI review)."""

    def check(text: str) -> str:
        known = names()
        if text not in known:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} profile {text!r}; choose from: {', '.join(known)}"
            )
        return text

    return check


def _engine_target(text: str) -> str:
    """``--engine``: ``URL`` or ``POOL=URL``, the URL checked as ``--prometheus``'s is (a bare
    ``HOST:PORT`` failed later with an httpx message: the CLI review)."""
    http_url("an engine URL")(parse_target(text).url)
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fleetgate advise``."""
    parser.description = (
        "Read each pool's engine flags and what it actually serves, and print the recommended\n"
        "value of each capacity flag with its evidence."
    )
    parser.epilog = EPILOG
    parser.formatter_class = HelpFormatter
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="FILE", help="a snapshot file (YAML or JSON)")
    source.add_argument(
        "--gateway", type=http_url("a gateway's URL"), metavar="URL",
        help="a running fleetgate gateway",
    )
    source.add_argument(
        "--engine", metavar="[POOL=]URL", action="append", type=_engine_target,
        help="a vLLM engine (repeatable)",
    )
    source.add_argument(
        "--prometheus", type=http_url("a Prometheus URL"), metavar="URL",
        help="a Prometheus scraping the gateway and engines",
    )
    parser.add_argument(
        "--window", type=promql_duration, default="10m",
        help="--prometheus: PromQL range (default: 10m)",
    )
    parser.add_argument(
        "--pool-label",
        default="pool",
        help="--prometheus: the engine series' label naming their pool (default: pool)",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("FLEETGATE_ADMIN_KEY"),
        help="the gateway's admin key, to list replicas (default: $FLEETGATE_ADMIN_KEY)",
    )
    parser.add_argument(
        "--samples", type=positive_int, default=5, help="scrapes of each engine (default 5)"
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between scrapes (default 2)"
    )
    parser.add_argument(
        "--window-lengths",
        action="store_true",
        help="request lengths from the watch window only (default: since the gateway or "
        "engine started)",
    )
    parser.add_argument(
        "--flags",
        metavar="[POOL=]FILE",
        action="append",
        default=[],
        help="YAML of flag: value the engines do not report (--max-num-seqs, TP, ...); "
        "without POOL= for every pool",
    )
    parser.add_argument(
        "--hardware", type=_profile_name("hardware", hardware_names),
        help="hardware profile for pools that name none, e.g. h100-sxm (no default)",
    )
    parser.add_argument(
        "--model", type=_profile_name("model", model_names),
        help="model profile for pools that name none, e.g. llama3-8b (no default)",
    )
    parser.add_argument("--sim-profile", help="simulator preset for --verify (e.g. tiny)")
    parser.add_argument("--pool", action="append", help="only these pools (repeatable)")
    parser.add_argument("--changes-only", action="store_true", help="print only the changes")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--save", metavar="FILE", help="also write what was read as a snapshot")
    verify = parser.add_argument_group("--verify: replay through `fleetgate simulate`")
    verify.add_argument(
        "--verify", action="store_true", help="simulate today's and the advised flags"
    )
    verify.add_argument("--trace", metavar="FILE", help="replay this trace instead")
    verify.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="synthetic trace size (default 2000); with --trace, replay only its first N",
    )
    verify.add_argument(
        "--rate", type=positive_float, help="requests/s of the synthetic trace"
    )
    verify.add_argument("--slo-ttft-ms", type=positive_float, default=2000.0, help="default 2000")
    verify.add_argument("--slo-tpot-ms", type=positive_float, default=50.0, help="default 50")
    verify.add_argument("--seed", type=int, default=0, help="trace and routing seed")
    parser.add_argument(
        "--timeout", type=positive_float, default=10.0, help="HTTP timeout, s (default 10)"
    )


def _given_flags(specs: list[str]) -> dict[str | None, EngineFlags]:
    given: dict[str | None, EngineFlags] = {}
    for spec in specs:
        pool, sep, path = spec.partition("=")
        given[pool if sep else None] = load_flags(path if sep else spec)
    return given


def load(args: argparse.Namespace) -> dict[str, PoolSnapshot]:
    """Pools from the chosen source, with --flags, profiles and --pool applied."""
    if args.input:
        pools = load_snapshot(args.input)
    elif args.prometheus:
        from planning.advise.prometheus_source import fetch_prometheus_pools

        with httpx.Client(timeout=args.timeout) as client:
            pools = fetch_prometheus_pools(args.prometheus, client, args.window, args.pool_label)
    else:
        if args.samples < 1 or not 0 <= args.interval <= MAX_INTERVAL_S:
            raise AdviceError(
                f"--samples must be >= 1 and --interval a number of seconds from 0 to "
                f"{MAX_INTERVAL_S:g} (got --samples {args.samples}, --interval {args.interval})"
            )
        with httpx.Client(timeout=args.timeout) as client:
            targets: list[Target]
            if args.gateway:
                targets = gateway_targets(args.gateway, args.admin_key, client)
            else:
                targets = [parse_target(text) for text in args.engine]
            pools = read_live(
                targets,
                client,
                samples=args.samples,
                interval_s=args.interval,
                gateway_url=args.gateway,
                window_lengths=args.window_lengths,
            )
    given = _given_flags(args.flags)
    if None in given:
        pools = overlay_flags(pools, {name: given[None] for name in pools})
    pools = overlay_flags(pools, {k: v for k, v in given.items() if k is not None})
    pools = {
        name: replace(
            pool,
            hardware=pool.hardware or args.hardware,
            model=pool.model or args.model,
            sim_profile=pool.sim_profile or args.sim_profile,
            measured=replace(pool.measured, request_rate_per_s=args.rate)
            if args.rate
            else pool.measured,
        )
        for name, pool in pools.items()
    }
    if args.pool:
        unknown = sorted(set(args.pool) - set(pools))
        if unknown:
            raise AdviceError(f"--pool {unknown[0]}: not read; pools: {', '.join(pools)}")
        pools = {name: pools[name] for name in args.pool}
    return pools


def run(args: argparse.Namespace) -> int:
    """Advise every pool; exit 2 on bad input, 1 when a source cannot be read."""
    try:
        pools = load(args)
        results = {name: advise(pool) for name, pool in pools.items()}
        checks = _verify(args, pools, results) if args.verify else {}
    except AdviceError as exc:
        print(f"fleetgate advise: error: {exc}", file=sys.stderr)
        return 2
    except SourceError as exc:
        print(f"fleetgate advise: cannot read the fleet: {exc}", file=sys.stderr)
        return 1
    if args.save:
        try:
            # yamlio.dump quotes strings such as a pool or model named "7e9", which
            # yamlio.load (what --input reads with) would otherwise take for numbers.
            Path(args.save).write_text(yamlio.dump(to_mapping(pools), sort_keys=False))
        except OSError as exc:
            print(f"fleetgate advise: cannot write {args.save}: {exc.strerror}", file=sys.stderr)
            return 2
    if args.json:
        payload = json.loads(to_json(pools, results))
        for name, rows in checks.items():
            payload[name]["verify"] = [row.to_dict() for row in rows]
        print(json.dumps(payload, indent=2))
        return 0
    print(to_text(pools, results, only_changes=args.changes_only))
    if checks:
        from planning.advise.verify import format_rows

        for name, rows in checks.items():
            print(f"\nverify pool {name} (fleetgate simulate, same trace and policy):")
            print(format_rows(rows))
    return 0


def _verify(args: argparse.Namespace, pools: dict[str, PoolSnapshot], results: dict) -> dict:
    # The simulator is heavy to import; only --verify pays for it.
    from planning.advise.verify import synthetic_trace, verify
    from traces.format import TraceFormatError, read_trace

    checks = {}
    given = None
    if args.trace:
        try:  # read once for every pool, and no further than --requests
            given = read_trace(args.trace, limit=args.requests)
        except (OSError, TraceFormatError) as exc:
            raise AdviceError(f"--trace: {exc}") from exc  # it names the file
    for name, pool in pools.items():
        if given is not None:
            records = given
        else:
            records = synthetic_trace(pool, args.requests or 2000, seed=args.seed)
        checks[name] = verify(
            pool,
            results[name],
            records,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            seed=args.seed,
        )
    return checks
