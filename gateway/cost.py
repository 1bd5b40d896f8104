"""Per-route prefix hit rate and cost per 1M tokens over a sliding window.

Cost attribution (documented in docs/cost.md): while ``n`` requests are in flight on a replica,
each is charged ``dt / n`` seconds of that replica's time (processor sharing), so the seconds
charged on a replica add up to the time it was busy. ``n`` counts the other gateways' requests
there too (shared through Redis): counted alone, each of N gateways charged its requests the whole
stretch, and the fleet's replica-seconds summed to N times its busy time. A pool's whole bill
over the window — busy *and* idle replica time, ``price_per_hour / 3600 x replicas x window`` —
is split among routes in proportion to the busy seconds they were charged on that pool (this
pod's: with several pods, the fleet-wide figure comes from the counters, docs/cost.md). A
route's cost per 1M tokens is its share of the bill divided by its tokens (prompt + completion)
in the window, times 10^6.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from routing.types import ReplicaId


@dataclass
class _Busy:
    """Processor-sharing clock of one replica."""

    last: float
    #: request key -> replica seconds charged so far
    charged: dict[int, float] = field(default_factory=dict)
    #: Other gateways' requests on the replica since ``last`` (as read then).
    others: int = 0


def _no_others(_replica: ReplicaId) -> int:
    return 0


class ReplicaTimeMeter:
    """Charges each in-flight request its share of its replica's time."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        others: Callable[[ReplicaId], int] = _no_others,
    ) -> None:
        """``others``: the other gateways' requests in flight on a replica (they share it)."""
        self._clock = clock
        self._others = others
        #: The replicas' time is shared with other gateways (``others`` given).
        self._shared = others is not _no_others
        self._replicas: dict[ReplicaId, _Busy] = {}

    def _advance(self, replica: ReplicaId) -> _Busy:
        now = self._clock()
        busy = self._replicas.setdefault(replica, _Busy(now))
        if busy.charged:
            share = (now - busy.last) / (len(busy.charged) + busy.others)
            for key in busy.charged:
                busy.charged[key] += share
        busy.last = now
        busy.others = max(0, self._others(replica))
        return busy

    def refresh(self) -> None:
        """Charge the time so far on every replica this gateway has requests on, and read the
        other gateways' counts there again: called after each sync of those counts, so a long
        request is not charged its whole stretch at the share read when it started."""
        if not self._shared:
            return  # alone: the counts read at this gateway's own events are exact
        for replica, busy in self._replicas.items():
            if busy.charged:
                self._advance(replica)

    def start(self, replica: ReplicaId, key: int) -> None:
        """Request ``key`` starts occupying ``replica``."""
        self._advance(replica).charged[key] = 0.0

    def finish(self, replica: ReplicaId, key: int) -> float:
        """Request ``key`` is done; returns the replica seconds charged to it."""
        return self._advance(replica).charged.pop(key, 0.0)


#: Per (route, pool): [replica_seconds, prompt_tokens, cached_tokens, completion_tokens].
_Totals = dict[tuple[str, str], list[float]]


class RouteWindow:
    """Completed requests over the last ``window_s`` seconds, per route: hit rate and cost.

    Requests are summed into one-second buckets per (route, pool), so memory is bounded by
    ``window_s`` x routes x pools whatever the request rate (a request leaves the window with
    its whole second).
    """

    def __init__(self, window_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        #: (second, totals of the requests completed in it), oldest first.
        self._buckets: deque[tuple[int, _Totals]] = deque()
        self._started = clock()

    def add(
        self,
        route: str,
        pool: str,
        replica_seconds: float,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
    ) -> None:
        """Record one completed request."""
        second = int(self._clock() // 1)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != second:
            buckets.append((second, {}))
            self._trim()
        totals = buckets[-1][1]
        row = totals.get((route, pool))
        if row is None:
            totals[(route, pool)] = [
                replica_seconds,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            ]
        else:
            row[0] += replica_seconds
            row[1] += prompt_tokens
            row[2] += cached_tokens
            row[3] += completion_tokens

    def _trim(self) -> None:
        horizon = self._clock() - self.window_s
        while self._buckets and self._buckets[0][0] + 1 <= horizon:
            self._buckets.popleft()

    def _rows(self) -> list[tuple[str, str, list[float]]]:
        self._trim()
        return [(route, pool, row) for _s, t in self._buckets for (route, pool), row in t.items()]

    def hit_rates(self) -> dict[str, float]:
        """Route -> cached / prompt tokens in the window (routes with prompt tokens only)."""
        prompt: dict[str, float] = defaultdict(float)
        cached: dict[str, float] = defaultdict(float)
        for route, _pool, row in self._rows():
            prompt[route] += row[1]
            cached[route] += row[2]
        return {r: cached[r] / p for r, p in prompt.items() if p > 0}

    def cost_per_1m(
        self, pool_usd_per_hour: Mapping[str, float], pool_replicas: Mapping[str, int]
    ) -> dict[str, float]:
        """Route -> USD per 1M tokens in the window (see the module docstring for the formula)."""
        rows = self._rows()
        # The window is shorter than window_s until the gateway has run that long.
        window = min(self.window_s, max(1e-9, self._clock() - self._started))
        busy_by_pool: dict[str, float] = defaultdict(float)
        busy: dict[tuple[str, str], float] = defaultdict(float)
        tokens: dict[str, float] = defaultdict(float)
        for route, pool, row in rows:
            busy_by_pool[pool] += row[0]
            busy[(route, pool)] += row[0]
            tokens[route] += row[1] + row[3]
        usd: dict[str, float] = defaultdict(float)
        for (route, pool), seconds in busy.items():
            price = pool_usd_per_hour.get(pool)
            if price is None or busy_by_pool[pool] <= 0:
                continue
            bill = price / 3600.0 * pool_replicas.get(pool, 1) * window
            usd[route] += bill * seconds / busy_by_pool[pool]
        return {r: usd[r] / tokens[r] * 1e6 for r in usd if tokens[r] > 0}
