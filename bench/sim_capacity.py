"""Benchmark: how many simulated replicas one CPU core hosts at a given per-replica request rate.

A child process pinned to one core runs ``start_sim_fleet(n, speed=1)`` (real time) and probes
its own event loop: a task that asks to sleep 10 ms and records how late it wakes (*loop lag*),
plus each engine driver's worst lateness against its modelled step schedule (*step lag*). The
parent process, pinned to another core when there is one, sends Poisson arrivals at
``--rate`` requests/s per replica (streaming completions: a shared system prompt per replica plus a
fresh user turn) and measures time to first token (TTFT) at the client.

The fleet grows (1, 2, 4, 8, …) until the loop lag p99 exceeds ``--max-lag-ms`` or the TTFT p95
exceeds the single-replica TTFT p95 by more than ``--max-ttft-inflation-ms``; the last size within
both bounds is the capacity. Run from the repository root::

    .venv/bin/python -m bench.sim_capacity

and it rewrites ``docs/benchmarks/sim-capacity.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np

DEFAULT_OUTPUT = Path("docs/benchmarks/sim-capacity.md")
WORDS = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi",
    "psi", "omega",
)


# --------------------------------------------------------------------------- the fleet process


async def _serve(args: argparse.Namespace) -> None:
    """Child: run the fleet, report URLs, probe loop lag until stdin closes, report lags."""
    from replica.sim.fleet import start_sim_fleet

    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def probe() -> None:
        while True:
            start = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - start - 0.01)

    async with start_sim_fleet(
        args.replicas, profile=args.profile, speed=1.0, kv_events="tcp://127.0.0.1:*",
        kv_replay=None,
    ) as fleet:
        print(json.dumps({"urls": fleet.urls}), flush=True)
        task = asyncio.create_task(probe())
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await reader.read()  # EOF: the parent is done
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        step_lags = [h.replica.driver.max_lag_s for h in fleet.replicas]
        lag = np.array(lags[len(lags) // 5:] or [0.0])  # skip the warm-up fifth
        print(json.dumps({
            "loop_lag_p99_ms": float(np.percentile(lag, 99) * 1e3),
            "loop_lag_max_ms": float(lag.max() * 1e3),
            "step_lag_max_ms": max(step_lags) * 1e3,
            "steps": sum(h.replica.driver.steps for h in fleet.replicas),
        }), flush=True)


# --------------------------------------------------------------------------- the load


@dataclass
class StepResult:
    """One fleet size's measurements."""

    replicas: int
    offered_rps: float
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    step_lag_max_ms: float
    fleet_cpu_pct: float


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one_request(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
    ttfts: list[float], failures: list[str],
) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                failures.append(str(resp.status))
                return
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - start
            if first is not None:
                ttfts.append(first)
    except aiohttp.ClientError as exc:
        failures.append(type(exc).__name__)


async def _load(
    urls: Sequence[str], rate: float, duration_s: float, warmup_s: float, prompt_words: int,
    max_tokens: int, seed: int,
) -> tuple[list[float], list[str]]:
    """Poisson arrivals at ``rate`` per replica; TTFTs of requests sent after the warm-up."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    failures: list[str] = []
    warm: list[float] = []
    systems = [" ".join(rng.choice(WORDS) for _ in range(prompt_words)) for _ in urls]
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def replica_load(index: int, url: str) -> None:
            local = random.Random(seed * 1000 + index)
            loop = asyncio.get_running_loop()
            begin = loop.time()
            next_at = begin + local.expovariate(rate)
            while next_at < begin + warmup_s + duration_s:
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                turn = " ".join(local.choice(WORDS) for _ in range(32))
                sink = ttfts if next_at >= begin + warmup_s else warm
                task = asyncio.create_task(
                    _one_request(session, url, systems[index] + " " + turn, max_tokens, sink,
                                 failures)
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += local.expovariate(rate)

        await asyncio.gather(*(replica_load(i, u) for i, u in enumerate(urls)))
        if tasks:
            await asyncio.gather(*tasks)
    return ttfts, failures


def _measure(args: argparse.Namespace, replicas: int) -> StepResult:
    cmd = [sys.executable, "-m", "bench.sim_capacity", "--serve", "--replicas", str(replicas),
           "--profile", args.profile]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(child.pid, {cores[0]})
        if len(cores) > 1:
            os.sched_setaffinity(0, set(cores[1:]))
        assert child.stdout is not None and child.stdin is not None
        urls = json.loads(child.stdout.readline())["urls"]
        cpu_start, wall_start = _cpu_seconds(child.pid), time.monotonic()
        ttfts, failures = asyncio.run(_load(
            urls, args.rate, args.duration, args.warmup, args.prompt_words, args.max_tokens,
            args.seed,
        ))
        cpu = (_cpu_seconds(child.pid) - cpu_start) / (time.monotonic() - wall_start)
        child.stdin.close()
        lags = json.loads(child.stdout.readline())
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.terminate()
        child.wait(timeout=30)
    ttft = np.array(ttfts or [float("nan")]) * 1e3
    return StepResult(
        replicas=replicas, offered_rps=args.rate * replicas, completed=len(ttfts),
        failed=len(failures), ttft_p50_ms=float(np.percentile(ttft, 50)),
        ttft_p95_ms=float(np.percentile(ttft, 95)), loop_lag_p99_ms=lags["loop_lag_p99_ms"],
        loop_lag_max_ms=lags["loop_lag_max_ms"], step_lag_max_ms=lags["step_lag_max_ms"],
        fleet_cpu_pct=cpu * 100,
    )


# --------------------------------------------------------------------------- report


def _report(args: argparse.Namespace, rows: list[StepResult], capacity: int, why: str) -> str:
    command = " ".join(["python -m bench.sim_capacity", *map(shlex.quote, sys.argv[1:])])
    lines = [
        "# Simulated replicas per CPU core",
        "",
        "How many simulated vLLM replicas (`replica/sim`, real-time `--speed 1`) one CPU core",
        "hosts while each serves a steady stream of requests. The fleet runs in one process",
        "pinned to one core; the load generator runs in another process on the other core.",
        "",
        "Generated by `bench/sim_capacity.py`; rerun it to refresh this page:",
        "",
        "```",
        f".venv/bin/{command.strip()}",
        "```",
        "",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}. The CPUs are shared with other work, so figures are "
        "noisy; treat the capacity as an order of magnitude.",
        f"- Engine preset: `{args.profile}`; KV events on (ZMQ PUB per replica), replay off.",
        f"- Load per replica: Poisson, {args.rate} req/s; prompt = a {args.prompt_words}-word "
        f"system prompt (one per replica) + a fresh 32-word turn; {args.max_tokens} streamed "
        f"output tokens; {args.warmup:g} s warm-up then {args.duration:g} s measured.",
        f"- Bounds: loop lag p99 ≤ {args.max_lag_ms:g} ms and TTFT p95 ≤ the 1-replica TTFT "
        f"p95 + {args.max_ttft_inflation_ms:g} ms.",
        "",
        "*Loop lag*: how late a 10 ms sleep in the fleet's event loop wakes. *Step lag*: the worst",
        "lateness of any engine step against its modelled schedule. *TTFT*: client-side, first",
        "streamed chunk. *CPU*: the fleet process's CPU time / wall time.",
        "",
        "| replicas | offered req/s | completed | failed | TTFT p50 / p95 (ms) "
        "| loop lag p99 / max (ms) | step lag max (ms) | fleet CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.replicas} | {r.offered_rps:g} | {r.completed} | {r.failed} | "
            f"{r.ttft_p50_ms:.1f} / {r.ttft_p95_ms:.1f} | {r.loop_lag_p99_ms:.1f} / "
            f"{r.loop_lag_max_ms:.1f} | {r.step_lag_max_ms:.1f} | {r.fleet_cpu_pct:.0f}% |"
        )
    lines += ["", f"**Capacity: {capacity} replicas per core** at {args.rate} req/s each "
              f"({why})."]
    passing = [r for r in rows if r.replicas == capacity]
    if passing and passing[0].fleet_cpu_pct > 0:
        per_replica = passing[0].fleet_cpu_pct / capacity
        lines += [
            "",
            f"At {capacity} replicas the fleet used {passing[0].fleet_cpu_pct:.0f}% of its core, "
            f"{per_replica:.2f}% per replica. Where the fleet hit a bound well below 100% CPU, "
            "the core was shared with other processes (the loop waited for the CPU, not for its "
            f"own work); an idle core would host roughly {int(80 / per_replica)} replicas at 80% "
            "CPU. Each replica's engine loop steps only while it has requests, so idle replicas "
            "cost nothing but memory.",
        ]
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim_capacity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--profile", default="h100-llama3-8b", help="engine preset")
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s per replica")
    parser.add_argument("--prompt-words", type=int, default=400, help="system prompt words")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per size")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per size")
    parser.add_argument("--max-lag-ms", type=float, default=20.0, help="loop lag p99 bound")
    parser.add_argument("--max-ttft-inflation-ms", type=float, default=25.0,
                        help="allowed TTFT p95 growth over the 1-replica TTFT p95, ms")
    parser.add_argument("--max-replicas", type=int, default=256, help="largest size tried")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args))
        return 0

    rows: list[StepResult] = []
    capacity, why = 0, f"no bound crossed up to {args.max_replicas} replicas"
    size = 1
    while size <= args.max_replicas:
        row = _measure(args, size)
        rows.append(row)
        print(row, flush=True)
        baseline = rows[0].ttft_p95_ms
        if row.loop_lag_p99_ms > args.max_lag_ms:
            why = f"at {size} the loop lag p99 was {row.loop_lag_p99_ms:.1f} ms"
            break
        if row.ttft_p95_ms > baseline + args.max_ttft_inflation_ms:
            why = f"at {size} TTFT p95 was {row.ttft_p95_ms:.0f} ms vs {baseline:.0f} ms"
            break
        capacity = size
        size *= 2
    args.output.write_text(_report(args, rows, capacity, why))
    print(f"capacity {capacity} ({why}); wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
