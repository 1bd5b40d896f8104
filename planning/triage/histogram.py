"""Quantiles from cumulative Prometheus histogram buckets, as PromQL's ``histogram_quantile``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def histogram_quantile(quantile: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``quantile`` of a histogram given as (upper bound ``le``, cumulative count) pairs.

    Linear interpolation inside the bucket holding the rank, as Prometheus does; a rank in the
    ``+Inf`` bucket returns the highest finite bound. ``None`` when the histogram is empty, or
    has no finite bucket to bound the rank by (Prometheus answers NaN there, not 0).
    """
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile must be in [0, 1] (got {quantile})")
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = quantile * total
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in ordered:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound if lower_count > 0 or ordered[0][0] != upper_bound else None
            if count == lower_count:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = upper_bound, count
    return lower_bound


def in_first_bucket(quantile: float, buckets: Sequence[tuple[float, float]]) -> bool:
    """True when the ``quantile`` falls in the first (finite) bucket of cumulative ``(le,
    count)`` ``buckets`` sorted by le: all the histogram says is "at most its bound" (vLLM's
    queue and prefill timers start with 0-0.3 s, where interpolating from 0 makes a figure up).
    The gateway's page has the same rule (``gateway/dashboard/histograms.py``: serving code
    imports no planning)."""
    if not buckets or buckets[-1][1] <= 0 or math.isinf(buckets[0][0]):
        return False
    return buckets[0][1] >= quantile * buckets[-1][1]
