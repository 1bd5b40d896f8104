"""More calls at once than redis-py's default pool holds (100), Redis healthy and idle.

redis-py 8's asyncio pool refuses the 101st connection at once ("Too many connections"), and
each gateway feature took that for an outage: token budgets stopped being enforced (399 of 400
requests admitted against a budget that holds 170), Responses follow-ups got 503, speculative
index writes were dropped (the load review). The gateway's clients now keep up to
``MAX_CONNECTIONS`` per node and, on a plain Redis, wait for a free one past that."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from bench.local_redis import LocalRedisCluster
from gateway.token_budgets import RedisBudgetStore
from routing.index.redis_client import connect
from routing.index.stream_writer import StreamIndexWriter
from routing.redis_urls import MAX_CONNECTIONS
from routing.types import BlockHash, Epoch, ReplicaId

BURST = 400


async def test_a_burst_of_budget_reservations_is_enforced_to_the_token(redis_url: str) -> None:
    store = RedisBudgetStore(redis_url)
    key = f"fleetgate:budget:burst-{uuid.uuid4().hex[:8]}:prompt:1"
    try:
        admitted = await asyncio.gather(
            *(store.reserve(key, 10, 1500, 120) for _ in range(BURST))
        )
        assert sum(admitted) == 150  # the budget holds 150 of them, burst or not
        assert await store.used(key) == 1500
    finally:
        await store.close()


async def test_a_burst_of_index_writes_past_the_old_pool_all_land(redis_url: str) -> None:
    # A generous call timeout: this is about the pool refusing connections, not their speed.
    prefix = f"burst{uuid.uuid4().hex[:8]}:"
    writer = StreamIndexWriter(redis_url, key_prefix=prefix, shards=4, timeout_s=5.0)
    rid = ReplicaId("pool/burst")
    try:
        await writer.set_epoch(rid, Epoch(1))
        await asyncio.gather(
            *(writer.record(rid, Epoch(1), [BlockHash(i + 1)]) for i in range(BURST))
        )
    finally:
        await writer.close()


def test_the_pool_is_larger_than_the_bursts_above() -> None:
    assert MAX_CONNECTIONS >= BURST  # a plain Redis client would wait past it, not fail


async def test_a_cluster_client_past_its_pool_waits_for_a_turn_rather_than_fails(
    redis_cluster: LocalRedisCluster,
) -> None:
    # redis-py's Cluster client refused a call at once when a node's pool was full; with 4
    # connections per node, 300 commands and 60 pipelines at once must all land.
    client = connect(f"{redis_cluster.url}?max_connections=4", socket_timeout=5.0)
    key = f"{{burst-{uuid.uuid4().hex[:8]}}}"
    try:
        await asyncio.gather(*(client.incr(f"{key}:n") for _ in range(300)))

        async def piped(i: int) -> None:
            async with client.pipeline(transaction=False) as pipe:
                pipe.incr(f"{key}:p")
                pipe.set(f"burst-{i}", i)  # another slot: another node, most of the time
                await pipe.execute()

        await asyncio.gather(*(piped(i) for i in range(60)))
        assert await client.get(f"{key}:n") == b"300"
        assert await client.get(f"{key}:p") == b"60"
        for node in client.get_nodes():
            assert len(node._connections) <= 4
    finally:
        await client.aclose()


async def test_a_cluster_call_that_finds_no_turn_in_time_says_why(
    redis_cluster: LocalRedisCluster,
) -> None:
    client = connect(f"{redis_cluster.url}?max_connections=1", socket_timeout=0.2)
    held, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with client.turn():
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    try:
        await held.wait()
        with pytest.raises(redis.ConnectionError, match=r"max_connections"):
            await client.get("burst-nothing")
        release.set()
        await holder
        assert await client.get("burst-nothing") is None  # the turn is back
    finally:
        release.set()
        await client.aclose()
