"""Spreading a trace's coarse timestamps over the interval they stand for.

Some public traces record arrivals coarsely: Mooncake's conversation trace stamps them in
3-second buckets (0, 3000, 5999, 9000, ... ms), so replayed as recorded, the ten or so requests
of a bucket arrive at the same instant and every bucket opens with a burst that the recorded
traffic never had. ``spread_arrivals`` moves each arrival later by a seeded offset drawn
uniformly from ``[0, spread_ms)``. With ``spread_ms`` equal to the bucket width, arrivals stay
within their own bucket, so the buckets keep their order (a conversation's next turn still
comes after its previous one), and each seed gives one plausible placement of the requests
inside their buckets: replays with several seeds then show how much a figure owes to where
those requests happened to fall.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from traces.format import TraceRecord

__all__ = ["CoarseTimestamps", "coarse_timestamps", "spread_arrivals"]

#: Requests per distinct timestamp, on average, from which a trace counts as bucketed.
BUCKETED_REQUESTS_PER_TIMESTAMP = 3.0


def spread_arrivals(
    records: Sequence[TraceRecord], spread_ms: int, seed: int
) -> tuple[TraceRecord, ...]:
    """``records`` with each timestamp moved later by a uniform draw from ``[0, spread_ms)``
    ms, seeded by ``seed``, in arrival order (ties keep the trace's order).

    ``spread_ms`` 0 returns the records as they are.
    """
    if spread_ms < 0:
        raise ValueError(f"spread_ms: must be >= 0 (got {spread_ms})")
    if spread_ms == 0:
        return tuple(records)
    rng = random.Random(f"{seed}:arrival-spread")
    moved = [
        replace(record, timestamp=record.timestamp + rng.randrange(spread_ms)) for record in records
    ]
    # A stable sort: requests that land on the same millisecond keep the trace's order.
    return tuple(sorted(moved, key=lambda record: record.timestamp))


@dataclass(frozen=True)
class CoarseTimestamps:
    """How a trace's arrivals are bucketed: requests per timestamp, and the buckets' spacing."""

    requests_per_timestamp: float
    #: The median gap between consecutive distinct timestamps (ms): the bucket width.
    bucket_ms: int


def coarse_timestamps(records: Sequence[TraceRecord]) -> CoarseTimestamps | None:
    """How ``records`` are bucketed, when their arrivals come in groups at shared timestamps
    (3 or more requests per distinct timestamp on average); None for a trace stamped finely
    enough that arrivals are mostly apart."""
    stamps = sorted({record.timestamp for record in records})
    if len(stamps) < 2 or len(records) / len(stamps) < BUCKETED_REQUESTS_PER_TIMESTAMP:
        return None
    gap = statistics.median_high(b - a for a, b in pairwise(stamps))
    return CoarseTimestamps(len(records) / len(stamps), gap)
