"""Soak: 100,000 requests through the gateway; its memory must not keep growing.

``fleetgate serve`` (quick start: expected-ttft, in-memory index, text blocks) in front of
simulated replicas (``fleetgate sim``, high ``--speed``, a few output tokens), each its own process
on loopback. A closed loop of ``--concurrency`` clients sends chat completions (a share of them
streamed, a share as ``/v1/completions``): a system prompt (one of 20) + a user turn unique to the
request, so the block index, the layout sketches and the decision log all see fresh entries the
whole time.

The gateway's RSS (psutil when installed, else ``/proc/PID/status`` VmRSS) is sampled every
``--sample-every`` requests. Baseline: after ``--warmup`` requests; pass = RSS at the end grew
less than 10 % over the baseline, and no request failed.

Run from the repository root::

    .venv/bin/python -m bench.soak                      # the committed 100k run
    .venv/bin/python -m bench.soak --requests 20000     # reduced (warm-up and samples scale)

and it rewrites ``docs/benchmarks/soak.md`` and ``docs/benchmarks/soak-rss.png``
(``--output``/``--plot`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from tqdm import tqdm

from bench._bench_common import (
    MODEL,
    Proc,
    cpu_seconds,
    drop_option,
    fleetgate_proc,
    machine_line,
    rss_bytes,
    sim_proc,
    wait_ready,
    words,
    write_page,
)

DEFAULT_OUTPUT = Path("docs/benchmarks/soak.md")
DEFAULT_PLOT = Path("docs/benchmarks/soak-rss.png")
MAX_GROWTH = 0.10
ADMIN_KEY = "soak-admin-key"


@dataclass
class Sample:
    """The gateway after ``requests`` completed requests."""

    requests: int
    elapsed_s: float
    rss_bytes: int
    cpu_s: float
    errors: int
    index: dict = field(default_factory=dict)


@dataclass
class Soak:
    """Counters shared by the client workers."""

    total: int
    sample_every: int
    gateway: Proc
    done: int = 0
    sent: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    pending_samples: list[int] = field(default_factory=list)
    started: float = 0.0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def make_body(
    rng: random.Random, systems: Sequence[str], users: Sequence[str], i: int,
    args: argparse.Namespace,
) -> dict:
    """Request ``i``: a chat (some streamed) or a completion, on a shared system prompt; the user
    turn unique to the request, or drawn from ``users`` (``--user-pool``)."""
    system = systems[rng.randrange(len(systems))]
    if users:
        user = users[rng.randrange(len(users))]
    else:
        user = f"request {i}: " + words(rng, args.user_words)
    roll = rng.random()
    if roll < args.completions_share:
        return {"model": MODEL, "prompt": system + "\n" + user, "max_tokens": args.max_tokens}
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": args.max_tokens,
    }
    if roll < args.completions_share + args.stream_share:
        body["stream"] = True
    return body


async def one(session: aiohttp.ClientSession, soak: Soak, body: dict) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    try:
        async with session.post(soak.gateway.url + path, json=body) as resp:
            payload = await resp.read()
            if resp.status != 200:
                soak.error(f"HTTP {resp.status}")
            elif body.get("stream"):
                if not payload.rstrip().endswith(b"data: [DONE]"):
                    soak.error("stream without [DONE]")
            elif b'"choices"' not in payload:
                soak.error("no choices")
    except (TimeoutError, aiohttp.ClientError) as exc:
        soak.error(type(exc).__name__)


async def index_stats(session: aiohttp.ClientSession, url: str) -> dict:
    try:
        async with session.get(
            url + "/admin/index", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as resp:
            return dict(await resp.json())
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return {"error": repr(exc)}


async def take_sample(session: aiohttp.ClientSession, soak: Soak, at: int) -> None:
    pid = soak.gateway.pid
    sample = Sample(
        at, time.monotonic() - soak.started, rss_bytes(pid), cpu_seconds(pid), soak.errors
    )
    sample.index = await index_stats(session, soak.gateway.url)
    soak.samples.append(sample)


async def drive(args: argparse.Namespace, log_dir: Path) -> Soak:
    sim, urls = sim_proc(args.replicas, args.speed, log_dir)
    gw = fleetgate_proc(urls, log_dir, extra=["--admin-key", ADMIN_KEY])
    soak = Soak(args.requests, args.sample_every, gw)
    rng = random.Random(args.seed)
    systems = [f"system prompt {i}: " + words(rng, args.system_words) for i in range(20)]
    users = [f"user {i}: " + words(rng, args.user_words) for i in range(args.user_pool)]
    marks = sorted({*range(args.sample_every, args.requests + 1, args.sample_every),
                    args.warmup, args.requests})
    try:
        sim.start()
        timeout = aiohttp.ClientTimeout(total=60)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            for url in urls:
                await wait_ready(session, Proc(sim.name, sim.argv, url, sim.log_path, sim.popen),
                                 "/health")
            gw.start()
            await wait_ready(session, gw, "/v1/models", timeout_s=90)
            soak.started = time.monotonic()
            await take_sample(session, soak, 0)
            bar = tqdm(total=args.requests, desc="soak", unit="req", mininterval=1.0)
            next_mark = iter(marks)
            mark = next(next_mark)
            deadline = time.monotonic() + args.max_minutes * 60

            async def worker() -> None:
                nonlocal mark
                while soak.sent < args.requests and time.monotonic() < deadline:
                    i = soak.sent
                    soak.sent += 1
                    await one(session, soak, make_body(rng, systems, users, i, args))
                    soak.done += 1
                    bar.update()
                    while mark is not None and soak.done >= mark:
                        at, mark = mark, next(next_mark, None)
                        await take_sample(session, soak, at)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            bar.close()
            if soak.done < args.requests:
                raise RuntimeError(f"stopped at {soak.done} requests: --max-minutes reached")
            if not gw.alive():
                raise RuntimeError(f"the gateway died:\n{gw.log_tail()}")
    finally:
        gw.stop()
        sim.stop()
    return soak


def plot(soak: Soak, warmup: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s.requests / 1000 for s in soak.samples]
    ys = [s.rss_bytes / 2**20 for s in soak.samples]
    base = next(s.rss_bytes for s in soak.samples if s.requests == warmup) / 2**20
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    ax.plot(xs, ys, marker="o", label="gateway RSS")
    ax.axhline(base, color="grey", linestyle=":", label=f"after warm-up ({warmup // 1000}k)")
    ax.axhline(base * (1 + MAX_GROWTH), color="red", linestyle="--", label="limit (+10 %)")
    ax.axvline(warmup / 1000, color="grey", linewidth=0.8)
    ax.set_xlabel("requests completed (thousands)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(0, max(max(ys), base * (1 + MAX_GROWTH)) * 1.15)
    ax.set_title("fleetgate serve: resident memory over the soak")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    entries = [s.index.get("entries") for s in soak.samples]
    if all(isinstance(e, int) for e in entries):
        ax2 = ax.twinx()
        (line,) = ax2.plot(xs, [e / 1000 for e in entries], color="tab:green", marker=".",
                           linewidth=1, alpha=0.7, label="index entries (k, right)")
        ax2.set_ylabel("block-index entries (thousands)")
        ax2.set_ylim(0, max(max(entries) / 1000, 1) * 1.15)
        handles.append(line)
        labels.append(line.get_label())
    ax.legend(handles, labels, loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def render(args: argparse.Namespace, soak: Soak, argv: Sequence[str], plot_path: Path) -> str:
    mib = 2**20
    by = {s.requests: s for s in soak.samples}
    warm, end = by[args.warmup], by[args.requests]
    growth = (end.rss_bytes - warm.rss_bytes) / warm.rss_bytes
    passed = growth < MAX_GROWTH and soak.errors == 0
    total_s = end.elapsed_s
    user_kind = (f"drawn from a fixed pool of {args.user_pool}" if args.user_pool
                 else "unique to the request")
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "-m", "bench.soak", *argv])
    lines = [
        "# Soak: gateway memory over 100,000 requests",
        "",
        "Does `fleetgate serve` hold its memory flat under sustained traffic? Requests through",
        "the gateway to simulated replicas; the gateway's resident memory (RSS) is sampled as the",
        "requests complete.",
        "",
        "Generated by `bench/soak.py`; rerun it to refresh this page and the plot:",
        "",
        "```",
        command,
        "```",
        "",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {machine_line()} (shared; timings are indicative only).",
        f"- Gateway: `fleetgate serve --replica …` quick start (expected-ttft, in-memory index,"
        f" text blocks), one worker. Upstream: `fleetgate sim --replicas {args.replicas} --speed"
        f" {args.speed:g}` in its own process, `max_tokens={args.max_tokens}`.",
        f"- Traffic: {args.requests:,} requests, closed loop at concurrency {args.concurrency}; "
        f"system prompt (one of 20, {args.system_words} words) + user turn ({args.user_words} "
        f"words) {user_kind}; {args.completions_share:.0%} `/v1/completions`, "
        f"{args.stream_share:.0%} streamed chat, the rest non-streamed chat.",
        f"- RSS from {'psutil' if _has_psutil() else '/proc/PID/status VmRSS'}, every "
        f"{args.sample_every:,} requests; baseline after {args.warmup:,} (warm-up).",
        "",
        "## Result",
        "",
        f"- RSS after warm-up ({args.warmup:,}): **{warm.rss_bytes / mib:.1f} MiB**; at the end "
        f"({args.requests:,}): **{end.rss_bytes / mib:.1f} MiB**; growth **{growth:+.1%}** "
        f"(limit < {MAX_GROWTH:.0%}).",
        f"- Errors: **{soak.errors}**"
        + (f" ({', '.join(f'{k}: {v}' for k, v in soak.error_kinds.items())})"
           if soak.errors else "") + ".",
        f"- Wall time {total_s:.0f} s ({args.requests / total_s:.0f} requests/s through the"
        " gateway, on a shared machine).",
        f"- **{'PASS' if passed else 'FAIL'}**",
        *_index_note(warm, end),
        "",
        f"![gateway RSS over the soak]({plot_path.name})",
        "",
        "| requests | elapsed s | RSS MiB | vs warm-up | gateway CPU s | req/s (segment) "
        "| index entries | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    previous = None
    for s in soak.samples:
        rel = f"{(s.rss_bytes - warm.rss_bytes) / warm.rss_bytes:+.1%}" \
            if s.requests >= args.warmup else "—"
        rate = "—"
        if previous is not None and s.elapsed_s > previous.elapsed_s:
            rate = f"{(s.requests - previous.requests) / (s.elapsed_s - previous.elapsed_s):.0f}"
        blocks = s.index.get("entries", "?")
        lines.append(
            f"| {s.requests:,} | {s.elapsed_s:.0f} | {s.rss_bytes / mib:.1f} | {rel} | "
            f"{s.cpu_s:.0f} | {rate} | {blocks} | {s.errors} |"
        )
        previous = s
    lines += [
        "",
        "*index entries*: distinct block hashes in the in-memory index (`GET /admin/index`)",
        "at each sample.",
        "",
    ]
    return "\n".join(lines)


def _index_note(warm: Sample, end: Sample) -> list[str]:
    """How much of the growth the block index's growth accounts for."""
    before, after = warm.index.get("entries"), end.index.get("entries")
    if not isinstance(before, int) or not isinstance(after, int) or after <= before:
        return []
    grown = end.rss_bytes - warm.rss_bytes
    return [
        "",
        f"Over the same span the in-memory block index went from {before:,} to {after:,} entries"
        f" (max_entries {end.index.get('max_entries', '?'):,}): "
        f"{grown / (after - before):.0f} bytes of RSS growth per entry added.",
    ]


def _has_psutil() -> bool:
    try:
        import psutil  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, help="baseline after this many (default: 10%%)")
    parser.add_argument("--sample-every", type=int, help="RSS sample period (default: 10%%)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--speed", type=float, default=1000.0, help="sim --speed")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--user-words", type=int, default=60)
    parser.add_argument("--user-pool", type=int, default=0,
                        help="draw user turns from this many fixed ones (0: unique per request)")
    parser.add_argument("--stream-share", type=float, default=0.2)
    parser.add_argument("--completions-share", type=float, default=0.1)
    parser.add_argument("--max-minutes", type=float, default=40.0, help="give up after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--plot", type=Path, help="PNG (default: soak-rss.png beside --output)")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temp dir)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup or max(1, args.requests // 10)
    args.sample_every = args.sample_every or max(1, args.requests // 10)
    if not 0 < args.warmup < args.requests:
        parser.error("--warmup must be between 0 and --requests")
    if args.plot is None:
        args.plot = DEFAULT_PLOT if args.output == DEFAULT_OUTPUT \
            else args.output.with_name(args.output.stem + "-rss.png")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fleetgate-soak-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        soak = asyncio.run(drive(args, log_dir))
    plot(soak, args.warmup, args.plot)
    shown = argv
    for option in ("--log-dir", "--output", "--plot"):
        shown = drop_option(shown, option)
    page = render(args, soak, shown, args.plot)
    write_page(args.output, page)
    print(page)
    samples = [{"requests": s.requests, "rss_bytes": s.rss_bytes, "index": s.index}
               for s in soak.samples]
    print(json.dumps(samples))
    by = {s.requests: s for s in soak.samples}
    growth = (by[args.requests].rss_bytes - by[args.warmup].rss_bytes) / by[args.warmup].rss_bytes
    return 0 if growth < MAX_GROWTH and soak.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
