"""One behaviour suite for every placement store (memory, Redis), plus Redis-only properties."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from adapters_registry.placement import (
    PlacementStore,
    PlacementUnavailable,
    Residency,
    merge_engine_report,
)
from adapters_registry.placement_memory import MemoryPlacementStore
from adapters_registry.placement_redis import RedisPlacementStore
from routing.types import ReplicaId
from tests.support.redis_server import RedisServer

R = ReplicaId("pool-a/replica-0")  # ids with '/' must work as key parts
OTHER = ReplicaId("pool-a/replica-1")


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, clock: Clock
) -> AsyncIterator[PlacementStore]:
    if request.param == "memory":
        yield MemoryPlacementStore(clock)
        return
    url = request.getfixturevalue("redis_url")
    client = Redis.from_url(url, decode_responses=True)
    s = RedisPlacementStore(client, key_prefix=f"t-{uuid.uuid4().hex[:8]}:", clock=clock)
    yield s
    await client.aclose()


async def test_mark_touch_and_snapshot(store: PlacementStore) -> None:
    await store.mark_resident(R, "org/lora:v1", 10.0)
    await store.mark_resident(R, "b", 11.0)
    await store.touch(R, "org/lora:v1", 20.0)
    await store.touch(R, "never-loaded", 20.0)  # no entry appears for it
    await store.mark_unloaded(R, "b", 30.0)
    snap = await store.snapshot(R, loads_since=0)
    assert snap.entries == {
        "org/lora:v1": Residency(True, changed_at=10.0, last_used=20.0),
        "b": Residency(False, changed_at=30.0, last_used=11.0),
    }
    assert snap.resident == {"org/lora:v1"}
    assert (await store.status(R, "org/lora:v1")).resident
    assert not (await store.status(R, "b")).resident
    assert (await store.snapshot(OTHER, 0)).entries == {}


async def test_sync_follows_the_pure_merge_rule(store: PlacementStore) -> None:
    await store.mark_resident(R, "fresh", 99.0)
    await store.mark_unloaded(R, "fresh-gone", 98.0)
    await store.mark_resident(R, "stale", 10.0)
    await store.mark_resident(R, "kept", 10.0)
    before = (await store.snapshot(R, 0)).entries
    engine = {"fresh-gone", "kept", "external"}
    await store.sync_from_engine(R, engine, read_at=100.0, grace_s=5.0)
    assert (await store.snapshot(R, 0)).entries == merge_engine_report(before, engine, 100.0, 5.0)


async def test_a_load_records_its_source_through_touch_and_engine_sync(
    store: PlacementStore,
) -> None:
    # A reload may re-source an adapter; which weights each copy holds must survive every write.
    await store.mark_resident(R, "a", 10.0, "/adapters/acme/a")
    await store.mark_resident(R, "b", 10.0)  # no source recorded
    await store.touch(R, "a", 20.0)
    await store.sync_from_engine(R, {"a", "b", "seen"}, read_at=100.0, grace_s=5.0)
    snap = await store.snapshot(R, 0)
    assert snap.entries["a"] == Residency(True, 10.0, 20.0, "/adapters/acme/a")
    assert snap.entries["b"].source is None and snap.entries["seen"].source is None
    status = await store.status(R, "a")
    assert status.source == "/adapters/acme/a"
    assert status.serves_weights("/adapters/acme/a") and not status.serves_weights("/other")
    await store.mark_unloaded(R, "a", 110.0)
    assert (await store.status(R, "a")).source is None


async def test_a_source_is_recorded_for_an_unrecorded_copy_only_and_in_one_step(
    store: PlacementStore,
) -> None:
    # A reload marks copies whose weights nobody recorded; a load that landed meanwhile (with
    # its source) must keep it, and the mark must not move the copy in LRU order.
    await store.sync_from_engine(R, {"seen"}, read_at=100.0, grace_s=5.0)
    await store.mark_resident(R, "loaded", 50.0, "/adapters/acme/loaded")
    await store.mark_resident(R, "gone", 50.0)
    await store.mark_unloaded(R, "gone", 60.0)
    before = (await store.snapshot(R, 0)).entries["seen"]
    assert await store.record_source_if_unknown(R, "seen", "|unknown")
    after = (await store.snapshot(R, 0)).entries["seen"]
    assert after == Residency(True, before.changed_at, before.last_used, "|unknown")
    assert not await store.record_source_if_unknown(R, "seen", "|again")
    assert not await store.record_source_if_unknown(R, "loaded", "|unknown")
    assert not await store.record_source_if_unknown(R, "gone", "|unknown")
    assert not await store.record_source_if_unknown(R, "never", "|unknown")
    assert (await store.status(R, "loaded")).source == "/adapters/acme/loaded"


async def test_leases_are_listed_for_telling_old_weights_requests_apart(
    store: PlacementStore, clock: Clock
) -> None:
    await store.begin_use(R, "a", "l1|/old", ttl_s=10)
    await store.begin_use(R, "a", "l2|/new", ttl_s=100)
    assert await store.leases(R, "a") == ["l1|/old", "l2|/new"]
    clock.now += 10
    assert await store.leases(R, "a") == ["l2|/new"]
    assert await store.leases(OTHER, "a") == []


async def test_leases_count_requests_in_flight_and_expire(
    store: PlacementStore, clock: Clock
) -> None:
    await store.mark_resident(R, "a", 1.0)
    await store.begin_use(R, "a", "l1", ttl_s=10)
    await store.begin_use(R, "a", "l2", ttl_s=100)
    assert (await store.snapshot(R, 0)).inflight == {"a": 2}
    await store.end_use(R, "a", "l2")
    assert (await store.snapshot(R, 0)).inflight == {"a": 1}
    clock.now += 10
    assert (await store.snapshot(R, 0)).inflight == {}


async def test_lock_is_exclusive_and_only_its_owner_releases_it(store: PlacementStore) -> None:
    assert await store.try_lock(R, "a", "g1", ttl_s=30)
    assert not await store.try_lock(R, "a", "g2", ttl_s=30)
    assert await store.try_lock(R, "b", "g2", ttl_s=30)  # per adapter
    assert await store.try_lock(OTHER, "a", "g2", ttl_s=30)  # per replica
    assert (await store.status(R, "a")).busy
    await store.unlock(R, "a", "g2")
    assert (await store.status(R, "a")).busy
    await store.unlock(R, "a", "g1")
    assert not (await store.status(R, "a")).busy


async def test_load_log_feeds_the_thrash_window(store: PlacementStore) -> None:
    for t in (100.0, 100.0, 150.0, 200.0):
        await store.record_load(R, t, keep_s=60)
    assert (await store.snapshot(R, loads_since=140.0)).recent_loads == (150.0, 200.0)
    assert (await store.snapshot(R, loads_since=0.0)).recent_loads == (150.0, 200.0)
    await store.record_load(OTHER, 100.0, keep_s=60)
    assert (await store.snapshot(OTHER, 0.0)).recent_loads == (100.0,)


async def test_forget_replica(store: PlacementStore) -> None:
    await store.mark_resident(R, "a", 1.0)
    await store.begin_use(R, "a", "l1", ttl_s=100)
    await store.try_lock(R, "a", "g1", ttl_s=100)
    await store.record_load(R, 1.0, keep_s=60)
    await store.mark_resident(OTHER, "a", 1.0)
    await store.forget_replica(R)
    snap = await store.snapshot(R, 0)
    assert (snap.entries, snap.inflight, snap.recent_loads) == ({}, {}, ())
    assert not (await store.status(R, "a")).busy
    assert (await store.snapshot(OTHER, 0)).resident == {"a"}


async def test_traffic_sums_the_other_writers_and_drops_old_buckets(
    store: PlacementStore,
) -> None:
    # Three gateways' pre-warm counts (adapter names with ':' and '/' must work).
    await store.put_traffic("g1", {(10, "org/lora:v1"): 3, (11, "b"): 1}, window_s=300)
    await store.put_traffic("g2", {(11, "b"): 2, (12, "org/lora:v1"): 4}, window_s=300)
    await store.put_traffic("g3", {(12, "b"): 5}, window_s=300)
    # Absolute counts: writing the same again (a retry after a timeout) counts nothing twice.
    await store.put_traffic("g2", {(11, "b"): 2, (12, "org/lora:v1"): 4}, window_s=300)
    assert await store.traffic(10, besides="g3") == {
        (10, "org/lora:v1"): 3, (11, "b"): 3, (12, "org/lora:v1"): 4,
    }
    assert await store.traffic(11, besides="g1") == {
        (11, "b"): 2, (12, "org/lora:v1"): 4, (12, "b"): 5,
    }
    assert await store.traffic(10, besides="g9") == {  # bucket 10 dropped for good
        (11, "b"): 3, (12, "org/lora:v1"): 4, (12, "b"): 5,
    }


async def test_redis_lock_carries_an_expiry_and_prefixes_isolate(redis_url: str) -> None:
    client = Redis.from_url(redis_url, decode_responses=True)
    one = RedisPlacementStore(client, key_prefix="iso-1:")
    two = RedisPlacementStore(client, key_prefix="iso-2:")
    try:
        assert await one.try_lock(R, "a", "g1", ttl_s=5)
        ttl_ms = await client.pttl(f"iso-1:adapters:lock|{R}|a")
        assert 0 < ttl_ms <= 5000
        assert await two.try_lock(R, "a", "g1", ttl_s=5)  # another prefix, another lock
        await one.mark_resident(R, "a", 1.0)
        assert (await two.snapshot(R, 0)).entries == {}
    finally:
        await client.delete(*[k async for k in client.scan_iter(match="iso-*")])
        await client.aclose()


async def test_redis_outage_raises_placement_unavailable(redis_server: RedisServer) -> None:
    store = RedisPlacementStore.from_url(redis_server.url)
    await store.mark_resident(R, "a", 1.0)
    redis_server.stop()
    with pytest.raises(PlacementUnavailable, match="adapter placement store"):
        await store.status(R, "a")
    await store.close()


async def test_redis_entries_stay_readable_by_the_previous_release(redis_url: str) -> None:
    """A rolling upgrade: gateways of the previous release read ``res`` entries as exactly three
    elements (a fourth made their snapshot raise). The source lives in a hash of its own."""
    client = Redis.from_url(redis_url, decode_responses=True)
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    try:
        s = RedisPlacementStore(client, key_prefix=prefix)
        await s.mark_resident(R, "a", 10.0, "/adapters/acme/a")
        await s.touch(R, "a", 20.0)
        resident, changed_at, last_used = json.loads(
            await client.hget(f"{prefix}adapters:res|{R}", "a")
        )
        assert (resident, changed_at, last_used) == (1, 10.0, 20.0)
        assert (await s.status(R, "a")).source == "/adapters/acme/a"
        # What a previous-release gateway writes (no source): read back with none recorded.
        await client.hset(f"{prefix}adapters:res|{R}", "b", "[1, 10.0, 20.0]")
        assert (await s.snapshot(R, 0)).entries["b"] == Residency(True, 10.0, 20.0)
        await s.mark_unloaded(R, "a", 30.0)
        assert await client.hget(f"{prefix}adapters:src|{R}", "a") is None
    finally:
        await client.aclose()


async def test_redis_an_engine_reported_copy_drops_a_stale_recorded_source(redis_url: str) -> None:
    """The mends review: a ``src`` value left behind (a previous-release gateway unloaded the
    adapter without clearing it) was read as the source of a copy the engine reported later."""
    client = Redis.from_url(redis_url, decode_responses=True)
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    try:
        s = RedisPlacementStore(client, key_prefix=prefix)
        await client.hset(f"{prefix}adapters:src|{R}", "a", "/adapters/old/a")
        await s.sync_from_engine(R, {"a"}, read_at=100.0, grace_s=5.0)
        assert (await s.status(R, "a")).source is None
    finally:
        await client.aclose()
