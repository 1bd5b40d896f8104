"""The chaos benchmark on a small scale: its fault proxy, and three quick faults end to end.

The end-to-end test runs ``bench.chaos`` (real processes: redis-server, two ``fleetgate sim``,
two agents, two gateways) through "replica killed", "Redis killed and restarted" and "network
stall gateway ↔ Redis", a few seconds each, and checks the benchmark's own invariants: no
request failed before its first byte while a replica was up, no stream broke off a replica that
was not killed, the fleet recovered, and stale index entries reached 0. Nothing here asserts a
duration; every wait is bounded and says what it waited for.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.chaos import Chaos, ChaosConfig
from bench.chaos_observe import index_snapshot
from bench.chaos_proxy import FaultProxy, Mode
from routing.index.stream_writer import StreamIndexWriter
from routing.types import BlockHash, Epoch, ReplicaId
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis

#: Bounds the end-to-end test as a whole: a guard against a hang, not a latency bound.
RUN_GUARD_S = 150


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_fault_proxy_stall_holds_bytes_and_heal_delivers_them() -> None:
    server = await _echo_server()
    proxy = await FaultProxy("echo", server.sockets[0].getsockname()[1]).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"one")
        assert await asyncio.wait_for(reader.readexactly(3), 5) == b"one"
        proxy.set_mode(Mode.STALL)
        writer.write(b"two")
        # Stalled: nothing can come back (the wait is how long we look, not a latency claim).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(3), 0.3)
        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(3), 5) == b"two"
        proxy.set_mode(Mode.REFUSE)
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(late_reader.read(10), 5) == b""  # closed at once
        late_writer.close()
        proxy.drop_all()
        assert await asyncio.wait_for(reader.read(10), 5) == b""  # the open one was reset
        writer.close()
    finally:
        await proxy.stop()
        server.close()


async def test_chaos_bench_small_run_keeps_its_invariants(tmp_path: Path) -> None:
    # "redis-killed" guards the fix of the chaos page's Found 1 (an empty Redis listing after the
    # restart dropped every replica from the gateways: 503s with the fleet up).
    config = ChaosConfig(faults=["replica-killed", "redis-killed", "redis-stall"], duration_s=3.0,
                         rate=15.0, replicas=2, speed=1.0, seed=0, plots_dir=None)
    run = await asyncio.wait_for(Chaos(config, tmp_path).run(), RUN_GUARD_S)
    assert [r.name for r in run.results] == ["replica-killed", "redis-killed", "redis-stall"]
    for result in run.results:
        context = f"{result.name}: {result} (logs in {tmp_path})"
        assert result.sent > 0, context
        assert result.succeeded > 0, context
        assert result.failed_before_first_byte == 0, context
        assert result.broken_elsewhere == 0, context
        assert result.recover_s is not None, context
        assert result.stale_zero_s is not None, context
        assert result.stale_after == 0, context


async def test_the_index_check_reads_the_mirrored_layout(
    redis_server: RedisServer,
) -> None:
    """The stale/missing columns read what gateways match in ``index.mode: mirror`` (the
    default): a replica's confirmed block set, while its epoch is live and its heartbeat
    current. (They read the lookup layout's block keys before, which mirror mode never writes:
    every engine block counted as missing and nothing could ever be stale.)"""
    writer = StreamIndexWriter(redis_server.url, timeout_s=2.0)
    truth = SimpleNamespace(replica_id="r0", truth=SimpleNamespace(blocks={1, 2, 3}))
    try:
        await writer.set_epoch(ReplicaId("r0"), Epoch(5))
        await writer.record(ReplicaId("r0"), Epoch(5), [BlockHash(2), BlockHash(3), BlockHash(4)])
        await writer.heartbeat(ReplicaId("r0"), 60.0)
        snap = await index_snapshot(redis_server.port, [truth], time.monotonic)  # type: ignore[list-item]
        assert snap.stale == {("r0", 4)}  # listed, not held: a lookup would be wrong
        assert snap.missing == 1  # held, not listed: cold
        assert snap.live_replicas == 1 and snap.block_keys == 3
        await writer.retire_epoch(ReplicaId("r0"), Epoch(5))
        retired = await index_snapshot(redis_server.port, [truth], time.monotonic)  # type: ignore[list-item]
        assert retired.stale == set() and retired.missing == 3 and retired.live_replicas == 0
    finally:
        await writer.close()
