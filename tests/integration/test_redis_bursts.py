"""More calls at once than redis-py's default pool holds (100), Redis healthy and idle.

redis-py 8's asyncio pool refuses the 101st connection at once ("Too many connections"), and
each gateway feature took that for an outage: token budgets stopped being enforced (399 of 400
requests admitted against a budget that holds 170), Responses follow-ups got 503, speculative
index writes were dropped (the load review). The gateway's clients now keep up to
``MAX_CONNECTIONS`` per node and, on a plain Redis, wait for a free one past that."""

from __future__ import annotations

import asyncio
import uuid

from gateway.token_budgets import RedisBudgetStore
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
