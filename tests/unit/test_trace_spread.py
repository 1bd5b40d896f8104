"""``traces.spread``: coarse timestamps spread within their buckets, per seed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from traces.format import TraceRecord
from traces.spread import coarse_timestamps, spread_arrivals


def _bucketed(buckets: int, per_bucket: int, width: int = 3000) -> list[TraceRecord]:
    """``per_bucket`` requests stamped at the start of each ``width``-ms bucket, as Mooncake's
    conversation trace records them; the request's number is its first hash id."""
    return [
        TraceRecord(b * width, 600, 20, (b * per_bucket + i,))
        for b in range(buckets)
        for i in range(per_bucket)
    ]


def test_zero_spread_replays_the_trace_as_recorded() -> None:
    records = _bucketed(3, 4)
    assert spread_arrivals(records, 0, seed=5) == tuple(records)


def test_a_bucket_is_spread_over_its_width_and_stays_in_it() -> None:
    records = _bucketed(20, 10)
    spread = spread_arrivals(records, 3000, seed=0)
    assert sorted(r.hash_ids for r in spread) == sorted(r.hash_ids for r in records)
    for moved in spread:
        bucket = moved.hash_ids[0] // 10
        assert bucket * 3000 <= moved.timestamp < (bucket + 1) * 3000
    # No longer a burst: the 200 requests land on (nearly) 200 distinct milliseconds.
    assert len({r.timestamp for r in spread}) > 190


def test_arrivals_come_out_in_order_and_buckets_keep_theirs() -> None:
    spread = spread_arrivals(_bucketed(30, 8), 3000, seed=1)
    stamps = [r.timestamp for r in spread]
    assert stamps == sorted(stamps)
    buckets = [r.hash_ids[0] // 8 for r in spread]
    assert buckets == sorted(buckets)


def test_a_seed_is_one_placement_and_another_seed_another() -> None:
    records = _bucketed(5, 10)
    assert spread_arrivals(records, 3000, seed=2) == spread_arrivals(records, 3000, seed=2)
    assert spread_arrivals(records, 3000, seed=2) != spread_arrivals(records, 3000, seed=3)


def test_everything_but_the_timestamp_is_kept() -> None:
    record = TraceRecord(1000, 12345, 67, (0, 1, 2), "tune-a")
    (moved,) = spread_arrivals([record], 500, seed=0)
    assert (moved.input_length, moved.output_length, moved.hash_ids, moved.adapter) == (
        12345,
        67,
        (0, 1, 2),
        "tune-a",
    )
    assert 1000 <= moved.timestamp < 1500


def test_a_negative_spread_is_refused() -> None:
    with pytest.raises(ValueError, match="spread_ms"):
        spread_arrivals(_bucketed(1, 1), -1, seed=0)


@given(
    stamps=st.lists(st.integers(0, 10**7), min_size=1, max_size=50),
    spread_ms=st.integers(1, 10**5),
    seed=st.integers(0, 2**31),
)
def test_every_arrival_moves_later_by_less_than_the_spread(
    stamps: list[int], spread_ms: int, seed: int
) -> None:
    records = [TraceRecord(t, 1, 1, (i,)) for i, t in enumerate(sorted(stamps))]
    spread = spread_arrivals(records, spread_ms, seed)
    assert len(spread) == len(records)
    original = {r.hash_ids: r.timestamp for r in records}
    for moved in spread:
        assert 0 <= moved.timestamp - original[moved.hash_ids] < spread_ms


def test_bucketed_arrivals_are_recognised_with_their_bucket_width() -> None:
    coarse = coarse_timestamps(_bucketed(20, 10))
    assert coarse is not None
    assert coarse.requests_per_timestamp == 10.0
    assert coarse.bucket_ms == 3000


def test_arrivals_stamped_apart_or_all_at_once_are_not_bucketed() -> None:
    apart = [TraceRecord(137 * i, 600, 20, (i,)) for i in range(50)]
    assert coarse_timestamps(apart) is None
    assert coarse_timestamps(_bucketed(1, 10)) is None  # one instant: no spacing to tell
    assert coarse_timestamps(spread_arrivals(_bucketed(20, 10), 3000, seed=0)) is None
