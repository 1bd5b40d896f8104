"""Benchmark: sizing figures of the mirrored index (docs/index.md, "Mirror mode: sizing").

Against a private ``redis-server`` (or ``REDIS_URL``), under a key prefix of its own, it measures:

* **Redis memory per block** held in the per-replica snapshot sets (``INFO memory``
  ``used_memory`` before and after, streams trimmed to nothing so only the sets count);
* **write rate**: engine-confirmed ``record`` events of ``--blocks-per-event`` blocks per second
  from one writer (each is one ``WRITE`` script: the set and the stream together), and the
  Redis server time per event (``INFO commandstats``);
* **catch-up time**: how long a new gateway's ``MirrorBlockIndex.start()`` takes to bootstrap
  ``--replicas`` replicas holding ``--blocks-per-replica`` blocks each, and its local memory.

Run from the repository root::

    .venv/bin/python -m bench.mirror_sizing

It prints a markdown table; docs/index.md quotes a run with its command.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import tracemalloc
import uuid

import redis.asyncio as aioredis

from routing.index import MirrorBlockIndex
from routing.index.stream_writer import StreamIndexWriter
from routing.types import Epoch, ReplicaId


async def run(args: argparse.Namespace, url: str) -> list[tuple[str, str]]:
    prefix = f"sizing-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    writer = StreamIndexWriter(url, key_prefix=prefix, timeout_s=5.0)
    rng = random.Random(1)
    rows: list[tuple[str, str]] = []
    try:
        replicas = [ReplicaId(f"pool/r{n}") for n in range(args.replicas)]
        for rid in replicas:
            await writer.set_epoch(rid, Epoch(1))
        await client.config_resetstat()
        memory_before = (await client.info("memory"))["used_memory"]
        events = 0
        started = time.perf_counter()
        for rid in replicas:
            for _ in range(args.blocks_per_replica // args.blocks_per_event):
                blocks = [rng.getrandbits(64) for _ in range(args.blocks_per_event)]
                await writer.record(rid, Epoch(1), blocks)
                events += 1
        elapsed = time.perf_counter() - started
        stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
        total_blocks = events * args.blocks_per_event
        rows.append((
            "write rate, one writer",
            f"{events / elapsed:,.0f} events/s of {args.blocks_per_event} blocks "
            f"({total_blocks / elapsed:,.0f} blocks/s)",
        ))
        if stats.get("calls"):
            rows.append((
                "Redis server time per event",
                f"{stats['usec'] / stats['calls']:.1f} µs ({args.blocks_per_event} blocks)",
            ))
        # Only the snapshot sets should count: empty the streams (they are capped anyway).
        layout = writer.layout
        for key in layout.all_events_keys():
            await client.xtrim(key, maxlen=0)
        memory_after = (await client.info("memory"))["used_memory"]
        per_block = (memory_after - memory_before) / total_blocks
        rows.append((
            "Redis memory per confirmed block (snapshot sets)",
            f"{per_block:.0f} bytes ({per_block:.0f} MB per million blocks)",
        ))
        # Stream memory: a gateway's guess for a 6,000-token prompt (375 blocks of 16 tokens).
        before_guesses = (await client.info("memory"))["used_memory"]
        guesses = 1000
        for n in range(guesses):
            blocks = [rng.getrandbits(64) for _ in range(375)]
            await writer.record(replicas[n % len(replicas)], Epoch(1), blocks, ttl_s=10.0)
        per_guess = ((await client.info("memory"))["used_memory"] - before_guesses) / guesses
        rows.append((
            "Redis memory per stream event (a 375-block guess)",
            f"{per_guess:,.0f} bytes; streams hold at most shards x stream_max_len events",
        ))
        mirror = MirrorBlockIndex(url, key_prefix=prefix, timeout_s=5.0, bootstrap_timeout_s=600)
        started = time.perf_counter()
        await mirror.start()
        catch_up = time.perf_counter() - started
        await mirror.close()
        # Memory on a second bootstrap: tracemalloc slows allocation, so not the timed one.
        tracemalloc.start()
        mirror = MirrorBlockIndex(url, key_prefix=prefix, timeout_s=5.0, bootstrap_timeout_s=600)
        await mirror.start()
        local_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        stats_local = await mirror.stats()
        await mirror.close()
        rows.append((
            "catch-up (bootstrap) of a new gateway",
            f"{catch_up:.2f} s for {args.replicas} replicas x {args.blocks_per_replica:,} "
            f"blocks ({total_blocks / catch_up:,.0f} blocks/s)",
        ))
        rows.append((
            "gateway memory of the mirror",
            f"{local_bytes / stats_local.entries:.0f} bytes per distinct block "
            f"({stats_local.entries:,} blocks, each held by one replica)",
        ))
    finally:
        keys = [key async for key in client.scan_iter(match=f"{{{prefix}*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
        await client.aclose()
        await writer.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mirror_sizing", description=__doc__)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--blocks-per-replica", type=int, default=4_096)
    parser.add_argument("--blocks-per-event", type=int, default=32)
    args = parser.parse_args()
    if min(args.replicas, args.blocks_per_replica, args.blocks_per_event) < 1:
        raise SystemExit("--replicas, --blocks-per-replica and --blocks-per-event must be >= 1")
    server = None
    url = os.environ.get("REDIS_URL")
    if not url:
        from bench.local_redis import RedisServer

        server = RedisServer().start()
        url = server.url
    try:
        rows = asyncio.run(run(args, url))
    finally:
        if server is not None:
            server.stop()
    print("| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"\ncommand: python -m bench.mirror_sizing {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
