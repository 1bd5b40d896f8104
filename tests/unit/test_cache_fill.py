"""The prefix-cache fill estimate behind fleet-cost's eviction term (cache_fill.py)."""

from __future__ import annotations

from typing import Any

from routing.policies.cache_fill import CacheFill
from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId

R = ReplicaId("r")


def rep(**fields: Any) -> ReplicaState:
    fields.setdefault("kv_capacity_blocks", 100)
    fields.setdefault("block_size", 16)
    return ReplicaState(replica_id=R, url="http://r", **fields)


def test_reported_blocks_plus_the_writes_since_the_reading() -> None:
    fill = CacheFill()
    assert fill.room_tokens(rep(cached_blocks=10, metrics_read_at=100.0)) == 1600 - 160
    fill.add(R, 300, at=99.0, elapsed=0.0)  # before the reading: the reading has it (or errs low)
    fill.add(R, 200, at=101.0, elapsed=1.0)  # after it: the reading cannot have it
    assert fill.room_tokens(rep(cached_blocks=10, metrics_read_at=100.0)) == 1600 - 160 - 200
    # A newer reading that includes both writes replaces them.
    assert fill.room_tokens(rep(cached_blocks=40, metrics_read_at=102.0)) == 1600 - 640


def test_without_a_reading_the_writes_of_the_epoch_count() -> None:
    fill = CacheFill()
    assert fill.room_tokens(rep()) == 1600
    fill.add(R, 1000, at=1.0, elapsed=1.0)
    fill.add(R, 1000, at=2.0, elapsed=2.0)
    assert fill.room_tokens(rep()) == 0  # full, never below 0
    assert fill.room_tokens(rep(epoch=Epoch(2))) == 1600  # a new incarnation holds nothing


def test_unknown_capacity_and_unseen_replicas() -> None:
    fill = CacheFill()
    fill.add(R, 500, at=1.0, elapsed=1.0)  # never scored: nothing to count it against
    assert fill.room_tokens(rep()) == 1600
    assert fill.room_tokens(rep(kv_capacity_blocks=None)) is None


def test_writes_kept_are_bounded_when_readings_stop() -> None:
    fill = CacheFill(max_writes=3)
    fill.room_tokens(rep(cached_blocks=0, metrics_read_at=0.0))
    for t in range(10):
        fill.add(R, 16, at=float(t + 1), elapsed=float(t))
    assert fill.room_tokens(rep(cached_blocks=0, metrics_read_at=0.0)) == 1600 - 3 * 16


def test_the_tail_age_is_that_of_the_oldest_write_still_in_the_cache() -> None:
    """LRU: a new write evicts the oldest content; of our writes, the latest that add up to the
    capacity (1,600 tokens here) are what the cache holds."""
    fill = CacheFill()
    assert fill.tail_age_s(R, 0.0) is None
    fill.room_tokens(rep())
    fill.add(R, 1000, at=0.0, elapsed=0.0)
    assert fill.tail_age_s(R, 5.0) == 5.0  # not full yet: the first write is still there
    fill.add(R, 1000, at=10.0, elapsed=10.0)
    fill.add(R, 1000, at=20.0, elapsed=20.0)
    # 20 s and 10 s fill 2,000 >= 1,600 tokens: the write at 0 s is gone.
    assert fill.tail_age_s(R, 25.0) == 15.0
    fill.room_tokens(rep(epoch=Epoch(2)))
    assert fill.tail_age_s(R, 25.0) is None  # a new incarnation: nothing of ours in it
