"""Benchmark: latency and throughput the gateway adds over calling a replica directly.

Four targets in front of the SAME simulated replicas (``fleetgate sim``, high ``--speed``, a few
output tokens, so replica time is small and stable), each its own process on loopback:

* ``direct``: the client round-robins over the replicas itself (the baseline);
* ``fleetgate``: ``fleetgate serve --replica …`` (quick start: expected-ttft, in-memory index,
  text blocks);
* ``sglang-router``: ``python -m sglang_router.launch_router --policy cache_aware``;
* ``vllm-router``: ``vllm-router --policy cache_aware`` (and ``round_robin`` with
  ``--vllm-round-robin``).

The routers come from their own venv, ``.venv-routers/`` (``bash bench/install_routers.sh``).
Requests are non-streaming chat completions with a 1,000-word prompt (an 800-word system prompt,
one of 8, + a 200-word user turn unique to the request); every target gets the same sequence.

* **Latency** (concurrency 1): rounds; in each round every target, in a shuffled order, serves
  ``--latency-per-round`` sequential requests. Added p50/p99 = target minus direct.
* **Throughput** (concurrency ``--concurrency``): rounds; in each round every target, shuffled,
  serves ``--tput-requests`` requests from that many concurrent clients. Requests/s is the median
  over rounds; also the ratio to direct and the router process's CPU ms per request.

Run from the repository root::

    bash bench/install_routers.sh            # once
    .venv/bin/python -m bench.gateway_overhead

and it rewrites ``docs/benchmarks/gateway-overhead.md``. ``--profile-gateway`` then runs fleetgate
alone under cProfile at the throughput concurrency and adds its top functions to the page.
Targets: fleetgate requests/s ≥ vllm-router's; fleetgate added p50 ≤ 2.5x sglang-router's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from bench._bench_common import (
    HOST,
    MODEL,
    ROUTERS_BIN,
    VENV_BIN,
    Proc,
    cpu_seconds,
    drop_option,
    fleetgate_proc,
    free_ports,
    machine_line,
    sim_proc,
    wait_ready,
    words,
    write_page,
)

PY = ".venv/bin/python"
DEFAULT_OUTPUT = Path("docs/benchmarks/gateway-overhead.md")
CHAT = "/v1/chat/completions"
TARGET_ADDED_P50_RATIO = 2.5  # fleetgate added p50 ≤ 2.5x sglang-router's


@dataclass
class Target:
    """One thing the client sends requests to."""

    name: str
    urls: list[str]  # base URLs; the client round-robins over them (one for a router)
    proc: Proc | None = None
    latencies_ms: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    cpu_ms_per_req: list[float] = field(default_factory=list)
    errors: int = 0
    _next: int = 0

    def url(self) -> str:
        self._next += 1
        return self.urls[self._next % len(self.urls)] + CHAT


def make_bodies(n: int, n_words: int, max_tokens: int, seed: int) -> list[bytes]:
    """``n`` request bodies: 80% of ``n_words`` is one of 8 system prompts, the rest unique."""
    rng = random.Random(seed)
    system_words = n_words * 4 // 5
    systems = [f"system prompt {i}: " + words(rng, system_words) for i in range(8)]
    bodies = []
    for i in range(n):
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": systems[rng.randrange(len(systems))]},
                {"role": "user", "content": f"request {i}: " + words(rng, n_words - system_words)},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        bodies.append(json.dumps(body).encode())
    return bodies


async def one(session: aiohttp.ClientSession, target: Target, body: bytes) -> float | None:
    """Send one request; its latency in ms, or None (and an error counted) if it failed."""
    start = time.perf_counter()
    try:
        async with session.post(
            target.url(), data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            payload = await resp.read()
            if resp.status != 200 or b'"choices"' not in payload:
                target.errors += 1
                return None
    except (TimeoutError, aiohttp.ClientError):
        target.errors += 1
        return None
    return (time.perf_counter() - start) * 1000


async def latency_round(
    session: aiohttp.ClientSession, target: Target, bodies: Sequence[bytes]
) -> None:
    for body in bodies:
        ms = await one(session, target, body)
        if ms is not None:
            target.latencies_ms.append(ms)


async def throughput_round(
    session: aiohttp.ClientSession, target: Target, bodies: Sequence[bytes], concurrency: int
) -> None:
    queue = list(reversed(bodies))
    errors_before = target.errors

    async def worker() -> None:
        while queue:
            await one(session, target, queue.pop())

    cpu_before = cpu_seconds(target.proc.pid) if target.proc else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    done = len(bodies) - (target.errors - errors_before)
    target.rates.append(done / elapsed)
    if target.proc is not None:
        target.cpu_ms_per_req.append((cpu_seconds(target.proc.pid) - cpu_before) * 1000 / done)


def router_procs(
    replicas: Sequence[str], log_dir: Path, vllm_round_robin: bool
) -> list[Proc]:
    """sglang-router and vllm-router (cache_aware; + vllm round_robin) on free ports."""
    specs = [("sglang-router", "sglang", "cache_aware"), ("vllm-router", "vllm", "cache_aware")]
    if vllm_round_robin:
        specs.append(("vllm-router-rr", "vllm", "round_robin"))
    procs = []
    for name, kind, policy in specs:
        port, metrics_port = free_ports(2)
        if kind == "sglang":
            argv = [str(ROUTERS_BIN / "python"), "-m", "sglang_router.launch_router"]
        else:
            argv = [str(ROUTERS_BIN / "vllm-router")]
        argv += [
            "--host", HOST, "--port", str(port), "--worker-urls", *replicas,
            "--policy", policy, "--prometheus-host", HOST, "--prometheus-port",
            str(metrics_port), "--log-level", "warning" if kind == "vllm" else "warn",
        ]
        procs.append(Proc(name, argv, f"http://{HOST}:{port}", log_dir / f"{name}.log"))
    return procs


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def router_versions() -> dict[str, str]:
    out = subprocess.run(
        [str(ROUTERS_BIN / "python"), "-m", "pip", "show", "sglang-router", "vllm-router"],
        capture_output=True, text=True, check=False,
    ).stdout
    versions, name = {}, None
    for line in out.splitlines():
        if line.startswith("Name:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Version:") and name:
            versions[name] = line.split(":", 1)[1].strip()
    return versions


async def run(args: argparse.Namespace, log_dir: Path) -> dict:
    sim, replica_urls = sim_proc(args.replicas, args.speed, log_dir)
    procs: list[Proc] = [sim]
    targets = [Target("direct", replica_urls)]
    gw = fleetgate_proc(replica_urls, log_dir, workers=args.workers)
    procs.append(gw)
    targets.append(Target("fleetgate", [gw.url], gw))
    if args.workers2:
        gw2 = fleetgate_proc(replica_urls, log_dir, workers=2)
        gw2.name, gw2.log_path = "fleetgate-w2", log_dir / "fleetgate-w2.log"
        procs.append(gw2)
        targets.append(Target("fleetgate --workers 2", [gw2.url], gw2))
    if not args.no_routers:
        for proc in router_procs(replica_urls, log_dir, args.vllm_round_robin):
            procs.append(proc)
            targets.append(Target(proc.name, [proc.url], proc))
    probe = json.loads(make_bodies(1, 10, 1, 0)[0])
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        sim.start()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for url in replica_urls:
                await wait_ready(session, sim_at(sim, url), "/health")
            for proc in procs[1:]:
                proc.start()
            for proc in procs[1:]:
                # A real completion, not a health probe: proves the router proxies to the sims.
                await wait_ready(session, proc, CHAT, timeout_s=90, body=probe)
            bodies = make_bodies(args.warmup + args.latency_rounds * args.latency_per_round
                                 + args.tput_rounds * args.tput_requests, args.words,
                                 args.max_tokens, args.seed)
            rng = random.Random(args.seed)
            warm = bodies[: args.warmup]
            for target in targets:  # warm-up: connections, caches, JIT-free but allocator-warm
                await throughput_round(session, target, warm, min(args.concurrency, 8))
                target.rates.clear()
                target.cpu_ms_per_req.clear()
            offset = args.warmup
            total = args.latency_rounds * len(targets)
            with tqdm(total=total, desc="latency (c=1)", unit="batch") as bar:
                for _ in range(args.latency_rounds):
                    batch = bodies[offset: offset + args.latency_per_round]
                    offset += args.latency_per_round
                    for target in rng.sample(targets, len(targets)):
                        await latency_round(session, target, batch)
                        bar.update()
            total = args.tput_rounds * len(targets)
            with tqdm(total=total, desc=f"throughput (c={args.concurrency})", unit="batch") as bar:
                for _ in range(args.tput_rounds):
                    batch = bodies[offset: offset + args.tput_requests]
                    offset += args.tput_requests
                    for target in rng.sample(targets, len(targets)):
                        await throughput_round(session, target, batch, args.concurrency)
                        bar.update()
            for proc in procs[1:]:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} died during the run:\n{proc.log_tail()}")
    finally:
        for proc in reversed(procs):
            proc.stop()
    return {"targets": targets, "procs": procs}


async def profile_gateway(args: argparse.Namespace, log_dir: Path) -> str:
    """fleetgate alone under cProfile at the throughput concurrency; its top functions."""
    sim, replica_urls = sim_proc(args.replicas, args.speed, log_dir, name="sim-profile")
    out = log_dir / "fleetgate.prof"
    gw = fleetgate_proc(
        replica_urls, log_dir,
        python_prefix=[
            sys.executable, "-m", "cProfile", "-o", str(out), str(VENV_BIN / "fleetgate")
        ],
    )
    gw.name, gw.log_path = "fleetgate-profiled", log_dir / "fleetgate-profiled.log"
    target = Target("fleetgate", [gw.url], gw)
    probe = json.loads(make_bodies(1, 10, 1, 0)[0])
    bodies = make_bodies(args.profile_requests, args.words, args.max_tokens, args.seed + 1)
    try:
        sim.start()
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            for url in replica_urls:
                await wait_ready(session, sim_at(sim, url), "/health")
            gw.start()
            await wait_ready(session, gw, CHAT, timeout_s=90, body=probe)
            step = max(1, len(bodies) // 20)
            for i in tqdm(range(0, len(bodies), step), desc="profile fleetgate", unit="batch"):
                await throughput_round(session, target, bodies[i: i + step], args.concurrency)
    finally:
        gw.stop(timeout_s=60)
        sim.stop()
    if not out.exists():
        return f"(no profile written; log tail:\n{gw.log_tail()})"
    requests = len(bodies) - target.errors
    rate = statistics.median(target.rates)
    head = f"{requests} requests at c={args.concurrency}, {rate:.0f} req/s under cProfile"
    return head + "\n\n" + hot_spots(out, requests)


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    root = str(Path(__file__).resolve().parent.parent) + "/"
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif path.startswith(root):
        path = path[len(root):]
    elif path.startswith("/"):
        path = "stdlib " + Path(path).name
    return f"`{path}:{line} {name}`" if path != "~" else f"`{name}`"


def hot_spots(prof: Path, requests: int) -> str:
    """Two tables from a cProfile dump: fleetgate's own functions by cumulative time, and all
    functions by self time; µs per request and share of the request handler's time."""
    stats = pstats.Stats(str(prof)).stats  # type: ignore[attr-defined]
    handler = next(
        (
            v[3]
            for k, v in stats.items()
            if k[2] == "handle" and k[0].endswith("gateway/request/handler.py")
        ),
        None,
    ) or max(v[3] for v in stats.values())
    root = str(Path(__file__).resolve().parent.parent) + "/"
    idle = ("poll' of 'select.epoll", "select")

    def own(key: tuple[str, int, str]) -> bool:
        return key[0].startswith(root) and "/.venv" not in key[0] and "/bench/" not in key[0]

    def table(rows: list[tuple[tuple[str, int, str], tuple]], col: int, title: str) -> list[str]:
        out = [f"| {title} | calls/req | µs/req | % of handler |", "|---|---|---|---|"]
        for key, (_cc, nc, tt, ct, _callers) in rows:
            seconds = ct if col == 3 else tt
            share = 100 * seconds / handler
            out.append(
                f"| {_where(key)} | {nc / requests:.1f} | {seconds * 1e6 / requests:.0f} "
                f"| {share:.1f} |"
            )
        return out

    mine = sorted(((k, v) for k, v in stats.items() if own(k)), key=lambda kv: -kv[1][3])
    skip = {"main", "run", "serve_forever", "_worker", "<module>", "envelope_errors",
            "chat_completions", "build_app", "create_app"}
    mine = [kv for kv in mine if kv[0][2] not in skip][:20]
    by_self = [kv for kv in sorted(stats.items(), key=lambda kv: -kv[1][2])
               if not any(word in kv[0][2] for word in idle)][:15]
    busy = sum(v[2] for k, v in stats.items() if not any(word in k[2] for word in idle))
    lines = [
        f"Process busy (all self time but the event loop's idle `epoll`): "
        f"{busy * 1e6 / requests:.0f} µs per request under the profiler, of which the request "
        f"handler (`gateway/request/handler.py handle`, cumulative) is "
        f"{handler * 1e6 / requests:.0f} µs ({100 * handler / busy:.0f} %); the rest is aiohttp's"
        " HTTP server and client plumbing, health polling and start-up. A coroutine's every"
        " resumption counts as a call (hence 2 calls/req for the handler).",
        "",
        *table(mine, 3, "fleetgate function (cumulative)"),
        "",
        *table(by_self, 2, "any function (self time)"),
    ]
    return "\n".join(lines)


def render(args: argparse.Namespace, result: dict, argv: Sequence[str], profile: str | None) -> str:
    targets: list[Target] = result["targets"]
    by = {t.name: t for t in targets}
    direct = by["direct"]
    d50, d99 = pct(direct.latencies_ms, 50), pct(direct.latencies_ms, 99)
    d_rate = statistics.median(direct.rates)
    versions = router_versions()
    lines = [
        "# Gateway overhead",
        "",
        "Latency the gateway adds over calling a replica directly, and requests/s, for a",
        "1,000-word prompt, against SGLang's router and vLLM's router in front of the same",
        "simulated replicas, measured in the same interleaved run.",
        "",
        "Generated by `bench/gateway_overhead.py`; rerun it to refresh this page:",
        "",
        "```",
        "bash bench/install_routers.sh   # once: .venv-routers/ with the pinned routers",
        " ".join(shlex.quote(a) for a in [PY, "-m", "bench.gateway_overhead", *argv]),
        "```",
        "",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {machine_line()}. The CPUs are shared with other work and with every",
        "  process of the benchmark (client, replicas, router), so absolute numbers drift;",
        "  compare within a column of one run.",
        f"- Routers: sglang-router {versions.get('sglang-router', '?')}, "
        f"vllm-router {versions.get('vllm-router', '?')} (`.venv-routers/`, "
        "`bench/install_routers.sh`); fleetgate from this tree, "
        f"`fleetgate serve --workers {args.workers}` quick start (expected-ttft, in-memory index,"
        " text blocks).",
        f"- Upstream: `fleetgate sim --replicas {args.replicas} --speed {args.speed:g}` "
        f"(one process), `max_tokens={args.max_tokens}`, non-streaming `/v1/chat/completions`.",
        f"- Prompt: {args.words} words = {args.words * 4 // 5}-word system prompt (one of 8) + "
        f"{args.words - args.words * 4 // 5}-word user turn unique to the request; the same request"
        " sequence for every target.",
        f"- Latency: concurrency 1, {args.latency_rounds} rounds × {args.latency_per_round} "
        f"requests per target ({args.latency_rounds * args.latency_per_round} each), target order"
        " shuffled every round. *Added* = target minus direct at the same percentile.",
        f"- Throughput: concurrency {args.concurrency}, {args.tput_rounds} rounds × "
        f"{args.tput_requests} requests per target, shuffled; median requests/s over rounds. "
        "*CPU/req* = the router process's user+sys CPU per request (all its threads).",
        f"- Warm-up: {args.warmup} requests per target first, not counted.",
        "",
        "| target | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s | req/s range "
        "| × direct | CPU/req ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in targets:
        p50, p99 = pct(t.latencies_ms, 50), pct(t.latencies_ms, 99)
        rate = statistics.median(t.rates)
        cpu = f"{statistics.median(t.cpu_ms_per_req):.2f}" if t.cpu_ms_per_req else "—"
        added = ("—", "—") if t is direct else (f"{p50 - d50:+.2f}", f"{p99 - d99:+.2f}")
        lines.append(
            f"| {t.name} | {p50:.2f} | {p99:.2f} | {added[0]} | {added[1]} | {rate:.0f} | "
            f"{min(t.rates):.0f}–{max(t.rates):.0f} | {rate / d_rate:.2f} | {cpu} | {t.errors} |"
        )
    lines.append("")
    fg = by["fleetgate"]
    fg_added = pct(fg.latencies_ms, 50) - d50
    fg_rate = statistics.median(fg.rates)
    checks = []
    if "vllm-router" in by:
        vr = statistics.median(by["vllm-router"].rates)
        ok = fg_rate >= vr
        checks.append(
            f"- fleetgate throughput ≥ vllm-router's (cache_aware): {fg_rate:.0f} vs {vr:.0f} "
            f"req/s ({fg_rate / vr:.2f}×): **{'yes' if ok else 'no'}**"
        )
    if "sglang-router" in by:
        sg_added = pct(by["sglang-router"].latencies_ms, 50) - d50
        ratio = fg_added / sg_added if sg_added > 0 else float("inf")
        ok = fg_added <= TARGET_ADDED_P50_RATIO * max(sg_added, 0.0)
        checks.append(
            f"- fleetgate added p50 ≤ {TARGET_ADDED_P50_RATIO}× sglang-router's: {fg_added:.2f} vs "
            f"{sg_added:.2f} ms ({ratio:.1f}×): **{'yes' if ok else 'no'}**"
        )
    lines += ["## Targets", "", *checks, ""]
    if profile:
        lines += [
            "## Where fleetgate's time goes (cProfile)",
            "",
            f"fleetgate alone under `cProfile`, {args.profile_requests} requests at concurrency "
            f"{args.concurrency}, same upstream and prompts (profiling slows it; read shares,"
            " not absolute times):",
            "",
            profile.rstrip(),
            "",
        ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--speed", type=float, default=1000.0, help="sim --speed")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--words", type=int, default=1000, help="prompt length in words")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--latency-rounds", type=int, default=20)
    parser.add_argument("--latency-per-round", type=int, default=25)
    parser.add_argument("--tput-rounds", type=int, default=5)
    parser.add_argument("--tput-requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1, help="fleetgate serve --workers")
    parser.add_argument("--workers2", action="store_true",
                        help="also run `fleetgate serve --workers 2` as a fifth target")
    parser.add_argument("--vllm-round-robin", action="store_true",
                        help="also run vllm-router --policy round_robin")
    parser.add_argument("--no-routers", action="store_true", help="direct and fleetgate only")
    parser.add_argument("--profile-gateway", action="store_true",
                        help="then profile fleetgate alone under cProfile")
    parser.add_argument("--profile-requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temp dir)")
    return parser.parse_args(argv)


def sim_at(sim: Proc, url: str) -> Proc:
    """A view of the sim process answering on ``url`` (one of its replicas)."""
    return Proc(sim.name, sim.argv, url, sim.log_path, sim.popen)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not args.no_routers and not (ROUTERS_BIN / "vllm-router").exists():
        print("bench.gateway_overhead: run `bash bench/install_routers.sh` first "
              "(or pass --no-routers)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fleetgate-overhead-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(args, log_dir))
        profile = asyncio.run(profile_gateway(args, log_dir)) if args.profile_gateway else None
    shown = drop_option(argv, "--log-dir")
    page = render(args, result, shown, profile)
    write_page(args.output, page)
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
