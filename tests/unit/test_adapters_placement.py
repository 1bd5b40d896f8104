"""Placement rules: eviction order, tiers, room, merging engine reports; the memory store."""

from __future__ import annotations

import pytest

from adapters_registry.placement import (
    ReplicaPlacement,
    Residency,
    SlotCapacity,
    capacity_of,
    eviction_candidates,
    merge_engine_report,
    needs_room,
)
from adapters_registry.placement_memory import MemoryPlacementStore
from routing.types import ReplicaId
from tests.unit.test_adapters_fixtures import replica

R = ReplicaId("r0")


def placement(used: dict[str, float], inflight: dict[str, int] | None = None) -> ReplicaPlacement:
    """Resident adapters with the given last-use times."""
    entries = {name: Residency(True, changed_at=0.0, last_used=t) for name, t in used.items()}
    return ReplicaPlacement(R, entries, inflight or {})


@pytest.mark.parametrize(
    ("used", "pinned", "inflight", "keep", "expected"),
    [
        ({"a": 3, "b": 1, "c": 2}, set(), {}, set(), ["b", "c", "a"]),
        ({"a": 3, "b": 1, "c": 2}, {"b"}, {}, set(), ["c", "a"]),
        ({"a": 3, "b": 1, "c": 2}, set(), {"b": 2}, set(), ["c", "a"]),
        ({"a": 3, "b": 1, "c": 2}, {"c"}, {"b": 1}, {"a"}, []),
        ({"x": 0, "a": 0, "m": 5}, set(), {}, set(), ["x", "a", "m"]),  # ties: by name, reversed
    ],
)
def test_eviction_candidates_lru_never_pinned_or_busy(
    used: dict[str, float],
    pinned: set[str],
    inflight: dict[str, int],
    keep: set[str],
    expected: list[str],
) -> None:
    assert eviction_candidates(placement(used, inflight), pinned, keep) == expected


def test_tombstones_are_neither_resident_nor_candidates() -> None:
    p = ReplicaPlacement(R, {"gone": Residency(False, 5.0, 1.0), "here": Residency(True, 1.0, 2.0)})
    assert p.resident == {"here"}
    assert eviction_candidates(p, set()) == ["here"]
    assert p.tier("gone", 4) is None


def test_tier_models_engine_lru_over_gpu_slots() -> None:
    p = placement({"a": 1, "b": 3, "c": 2})
    assert [p.tier(n, 2) for n in "abc"] == ["host", "gpu", "gpu"]
    assert p.tier("a", None) == "gpu"  # slot count unknown: assume it fits
    assert p.tier("zzz", 2) is None


@pytest.mark.parametrize(
    ("resident", "capacity", "excess"),
    [
        (2, SlotCapacity(gpu=2, host=4), 0),
        (4, SlotCapacity(gpu=2, host=4), 1),
        (5, SlotCapacity(gpu=2, host=4), 2),  # over-full (another gateway raced): catch up
        (2, SlotCapacity(gpu=2, host=None), 1),
        (9, SlotCapacity(gpu=None, host=None), 0),
    ],
)
def test_needs_room(resident: int, capacity: SlotCapacity, excess: int) -> None:
    p = placement({f"a{i}": float(i) for i in range(resident)})
    assert needs_room(p, capacity) == excess


def test_capacity_prefers_engine_report_over_pool_config() -> None:
    assert capacity_of(replica("r", max_loras=3), 1, 6) == SlotCapacity(gpu=3, host=6)
    assert capacity_of(replica("r", max_cpu_loras=5), 1, 6) == SlotCapacity(gpu=1, host=5)
    assert capacity_of(replica("r"), None, None).resident_limit is None


def test_merge_engine_report_keeps_fresh_local_changes_only() -> None:
    local = {
        "loading-done": Residency(True, changed_at=99.0, last_used=99.0),  # after the report
        "unloaded-now": Residency(False, changed_at=98.0, last_used=50.0),  # after the report
        "old-resident": Residency(True, changed_at=10.0, last_used=60.0),
        "old-gone": Residency(False, changed_at=10.0, last_used=5.0),
        "evicted-by-engine": Residency(True, changed_at=10.0, last_used=7.0),
    }
    engine = {"unloaded-now", "old-resident", "old-gone", "external"}
    merged = merge_engine_report(local, engine, read_at=100.0, grace_s=5.0)
    assert merged == {
        "loading-done": local["loading-done"],
        "unloaded-now": local["unloaded-now"],
        "old-resident": local["old-resident"],
        "old-gone": Residency(True, changed_at=100.0, last_used=5.0),
        "external": Residency(True, changed_at=100.0, last_used=0.0),
    }


class Clock:
    """A settable clock for lock and lease expiry."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_lock_expires_and_only_owner_unlocks() -> None:
    clock = Clock()
    store = MemoryPlacementStore(clock)
    assert await store.try_lock(R, "a", "g1", ttl_s=5)
    assert not await store.try_lock(R, "a", "g2", ttl_s=5)
    assert (await store.status(R, "a")).busy
    await store.unlock(R, "a", "g2")  # not the owner: no effect
    assert not await store.try_lock(R, "a", "g2", ttl_s=5)
    clock.now += 5
    assert await store.try_lock(R, "a", "g2", ttl_s=5)
    await store.unlock(R, "a", "g1")  # g1's lock expired; must not free g2's
    assert (await store.status(R, "a")).busy


async def test_memory_leases_count_and_expire() -> None:
    clock = Clock()
    store = MemoryPlacementStore(clock)
    await store.mark_resident(R, "a", 1.0)
    await store.begin_use(R, "a", "l1", ttl_s=10)
    await store.begin_use(R, "a", "l2", ttl_s=100)
    assert (await store.snapshot(R, 0)).inflight == {"a": 2}
    await store.end_use(R, "a", "l2")
    assert (await store.snapshot(R, 0)).inflight == {"a": 1}
    clock.now += 10  # a gateway that died never ends l1
    assert (await store.snapshot(R, 0)).inflight == {}
