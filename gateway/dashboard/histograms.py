"""Cumulative Prometheus samples as the dashboard reads them, and quantiles over a time window.

The dashboard page reads the very samples ``/metrics`` renders (the gateway's registry) and the
engines' own ``/metrics``, so its numbers and a Prometheus scrape agree. Counters and histogram
buckets are cumulative; a ``SampleWindow`` keeps a few snapshots and subtracts the one taken at
the start of the window, which is what ``rate()``/``increase()`` do in PromQL.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: (metric sample name, sorted label items): one series.
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Snapshot:
    """Every cumulative sample at one moment (``at``: seconds on a monotonic clock)."""

    at: float
    values: Mapping[SeriesKey, float]

    def sum_by(self, name: str, by: str, **match: str) -> dict[str, float]:
        """``sum by (by) (name{match})``: label value -> sum of matching series."""
        out: dict[str, float] = {}
        for (sample, labels), value in self.values.items():
            if sample != name:
                continue
            items = dict(labels)
            if any(items.get(k) != v for k, v in match.items()):
                continue
            group = items.get(by, "")
            out[group] = out.get(group, 0.0) + value
        return out

    def buckets_by(self, histogram: str, by: str) -> dict[str, list[tuple[float, float]]]:
        """``sum by (by, le) (histogram_bucket)``: label value -> [(le, cumulative count)]."""
        grouped: dict[str, dict[float, float]] = {}
        for (sample, labels), value in self.values.items():
            if sample != f"{histogram}_bucket":
                continue
            items = dict(labels)
            le = float(items.get("le", "+Inf"))
            row = grouped.setdefault(items.get(by, ""), {})
            row[le] = row.get(le, 0.0) + value
        return {group: sorted(row.items()) for group, row in grouped.items()}


def snapshot(at: float, samples: Iterable[tuple[str, Mapping[str, str], float]]) -> Snapshot:
    """A snapshot from ``(sample name, labels, value)`` triples."""
    values: dict[SeriesKey, float] = {}
    for name, labels, value in samples:
        key = (name, tuple(sorted(labels.items())))
        values[key] = values.get(key, 0.0) + value
    return Snapshot(at, values)


def difference(latest: Snapshot, baseline: Snapshot) -> Snapshot:
    """``latest - baseline`` per series; a series that went down (a restarted engine) restarts."""
    values = {}
    for key, value in latest.values.items():
        before = baseline.values.get(key, 0.0)
        values[key] = value - before if value >= before else value
    return Snapshot(latest.at - baseline.at, values)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative ``(le, count)`` buckets, sorted by le.

    None when the histogram holds no observation. Linear interpolation inside the bucket that
    holds the rank; a rank in the ``+Inf`` bucket answers the highest finite bound.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def in_first_bucket(q: float, buckets: list[tuple[float, float]]) -> bool:
    """True when the ``q`` quantile falls in the first (finite) bucket, from 0: all the
    histogram says is "at most its bound" (vLLM's queue and prefill timers start with 0-0.3 s,
    where interpolating puts every healthy fleet's p50 at 150 ms)."""
    if not buckets or buckets[-1][1] <= 0 or math.isinf(buckets[0][0]):
        return False
    return buckets[0][1] >= q * buckets[-1][1]


class SampleWindow:
    """Snapshots over the last ``window_s``: ``increase`` is latest minus the window's first.

    Starts with an empty snapshot at creation, so until the gateway has run ``window_s`` the
    window is "since start" and counts match the cumulative ``/metrics`` exactly.
    """

    def __init__(self, window_s: float, started_at: float) -> None:
        self.window_s = window_s
        self._snapshots: deque[Snapshot] = deque([Snapshot(started_at, {})])

    def add(self, latest: Snapshot) -> Snapshot:
        """Record ``latest``; return the increase over the window (``at``: the window's length)."""
        horizon = latest.at - self.window_s
        # Keep the newest snapshot at or before the horizon as the baseline.
        while len(self._snapshots) > 1 and self._snapshots[1].at <= horizon:
            self._snapshots.popleft()
        baseline = self._snapshots[0]
        # Several open pages poll every ~2 s: one snapshot a second is plenty and bounds memory.
        if latest.at - self._snapshots[-1].at >= 1.0:
            self._snapshots.append(latest)
        return difference(latest, baseline)
