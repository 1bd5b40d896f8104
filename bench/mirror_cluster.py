"""Benchmark: the mirrored index's writes on one Redis server and on a Redis Cluster.

Starts a private ``redis-server`` and a private Redis Cluster of ``--primaries`` primaries (real
``redis-server`` processes, ``redis-cli --cluster create``), and on each, under a key prefix of
its own with ``--shards`` stream shards:

* **writes**: ``--replicas`` replicas each record ``--events`` engine-confirmed events of
  ``--blocks-per-event`` blocks (the agents' ``WRITE`` script), ``--concurrency`` in flight at a
  time from one client, and the Redis server time they cost, per primary (``INFO commandstats``);
* **catch-up**: how long a new gateway's ``MirrorBlockIndex.start()`` takes to read it all back.

What it shows: on a Cluster each primary executes the writes of the shards whose slots it owns,
so the server time per primary is the single server's divided by about the number of primaries;
that is the write capacity a Cluster adds when its primaries run on their own cores. On one
machine all primaries and the client share its cores, so the events/s here are not the Cluster's
capacity. Run from the repository root::

    .venv/bin/python -m bench.mirror_cluster

It prints a markdown table; docs/index.md ("Redis Cluster") quotes a run with its command.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from bench.local_redis import LocalRedisCluster, RedisServer
from routing.index import MirrorBlockIndex
from routing.index.redis_client import connect
from routing.index.stream_writer import StreamIndexWriter
from routing.types import Epoch, ReplicaId


@dataclass
class Result:
    """One store's figures."""

    store: str
    events: int
    seconds: float
    #: Primary ("host:port") -> (events it executed, its server time in µs).
    per_primary: dict[str, tuple[int, int]]
    catch_up_s: float


async def _script_stats(url: str) -> dict[str, tuple[int, int]]:
    """Per primary: (``EVALSHA`` calls, their µs) since the last ``CONFIG RESETSTAT``."""
    client = connect(url)
    try:
        if isinstance(client, aioredis.RedisCluster):
            infos = await client.info("commandstats", target_nodes=aioredis.RedisCluster.PRIMARIES)
        else:
            infos = {url.split("//")[1].split("/")[0]: await client.info("commandstats")}
        return {
            node: (
                int(info.get("cmdstat_evalsha", {}).get("calls", 0)),
                int(info.get("cmdstat_evalsha", {}).get("usec", 0)),
            )
            for node, info in infos.items()
        }
    finally:
        await client.aclose()


async def _reset_stats(url: str) -> None:
    client = connect(url)
    try:
        if isinstance(client, aioredis.RedisCluster):
            await client.config_resetstat(target_nodes=aioredis.RedisCluster.PRIMARIES)
        else:
            await client.config_resetstat()
    finally:
        await client.aclose()


async def measure(store: str, url: str, args: argparse.Namespace) -> Result:
    # A fixed prefix: on a fresh Cluster the shards' slots, so their primaries, are the same
    # from run to run (the servers are private and thrown away afterwards).
    prefix = "cluster-bench"
    writer = StreamIndexWriter(url, key_prefix=prefix, shards=args.shards, timeout_s=5.0)
    rng = random.Random(1)
    replicas = [ReplicaId(f"pool/r{n}") for n in range(args.replicas)]
    try:
        for rid in replicas:
            await writer.set_epoch(rid, Epoch(1))
        await _reset_stats(url)
        jobs = [
            (rid, [rng.getrandbits(64) for _ in range(args.blocks_per_event)])
            for _ in range(args.events)
            for rid in replicas
        ]
        slots = asyncio.Semaphore(args.concurrency)

        async def write(rid: ReplicaId, blocks: list[int]) -> None:
            async with slots:
                await writer.record(rid, Epoch(1), blocks)

        started = time.perf_counter()
        await asyncio.gather(*(write(rid, blocks) for rid, blocks in jobs))
        seconds = time.perf_counter() - started
        per_primary = await _script_stats(url)
        mirror = MirrorBlockIndex(
            url, key_prefix=prefix, shards=args.shards, timeout_s=5.0, bootstrap_timeout_s=600
        )
        started = time.perf_counter()
        await mirror.start()
        catch_up = time.perf_counter() - started
        await mirror.close()
    finally:
        await writer.close()
    return Result(store, len(jobs), seconds, per_primary, catch_up)


def render(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        "| store | events/s (one client) | primary | share of events | server µs / event | "
        "server time on this primary (s) | catch-up of a new gateway |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        total = sum(calls for calls, _ in result.per_primary.values()) or 1
        for n, (node, (calls, usec)) in enumerate(sorted(result.per_primary.items())):
            first = n == 0
            cells = [
                result.store if first else "",
                f"{result.events / result.seconds:,.0f}" if first else "",
                node,
                f"{calls / total:.0%}",
                f"{usec / calls if calls else 0:.1f}",
                f"{usec / 1e6:.3f}",
                f"{result.catch_up_s:.2f} s" if first else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    blocks = args.replicas * args.events * args.blocks_per_event
    lines += [
        "",
        f"{args.replicas} replicas x {args.events} events of {args.blocks_per_event} blocks "
        f"({blocks:,} blocks), {args.shards} shards, {args.concurrency} writes in flight.",
        f"command: python -m bench.mirror_cluster {' '.join(sys.argv[1:])}",
    ]
    return "\n".join(lines)


async def run(args: argparse.Namespace, server_url: str, cluster_url: str) -> list[Result]:
    return [
        await measure("one server", server_url, args),
        await measure(f"Cluster, {args.primaries} primaries", cluster_url, args),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mirror_cluster", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--primaries", type=int, default=3, help="Cluster primaries")
    parser.add_argument("--shards", type=int, default=16, help="stream shards (index.shards)")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--events", type=int, default=100, help="events per replica")
    parser.add_argument("--blocks-per-event", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32, help="writes in flight")
    args = parser.parse_args()
    if min(args.primaries, args.shards, args.replicas, args.events, args.blocks_per_event,
           args.concurrency) < 1:
        raise SystemExit("every option must be >= 1")
    server = RedisServer().start()
    cluster = LocalRedisCluster(primaries=args.primaries)
    try:
        cluster.start()
        results = asyncio.run(run(args, server.url, cluster.url))
    finally:
        server.stop()
        cluster.stop()
    print(render(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
