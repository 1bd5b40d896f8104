"""Per-route prefix hit rate and cost per 1M tokens over a sliding window.

Cost attribution (documented in docs/cost.md): while ``n`` requests are in flight on a replica,
each is charged ``dt / n`` seconds of that replica's time (processor sharing), so the seconds
charged on a replica add up to the time it was busy. A pool's whole bill over the window — busy
*and* idle replica time, ``price_per_hour / 3600 x replicas x window`` — is split among routes in
proportion to the busy seconds they were charged on that pool. A route's cost per 1M tokens is its
share of the bill divided by its tokens (prompt + completion) in the window, times 10^6.
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


class ReplicaTimeMeter:
    """Charges each in-flight request its share of its replica's time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._replicas: dict[ReplicaId, _Busy] = {}

    def _advance(self, replica: ReplicaId) -> _Busy:
        now = self._clock()
        busy = self._replicas.setdefault(replica, _Busy(now))
        if busy.charged:
            share = (now - busy.last) / len(busy.charged)
            for key in busy.charged:
                busy.charged[key] += share
        busy.last = now
        return busy

    def start(self, replica: ReplicaId, key: int) -> None:
        """Request ``key`` starts occupying ``replica``."""
        self._advance(replica).charged[key] = 0.0

    def finish(self, replica: ReplicaId, key: int) -> float:
        """Request ``key`` is done; returns the replica seconds charged to it."""
        return self._advance(replica).charged.pop(key, 0.0)


@dataclass
class _Sample:
    at: float
    route: str
    pool: str
    replica_seconds: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class RouteWindow:
    """Completed requests over the last ``window_s`` seconds, per route: hit rate and cost."""

    def __init__(self, window_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[_Sample] = deque()
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
        self._samples.append(
            _Sample(
                self._clock(),
                route,
                pool,
                replica_seconds,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            )
        )
        self._trim()

    def _trim(self) -> None:
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0].at < horizon:
            self._samples.popleft()

    def hit_rates(self) -> dict[str, float]:
        """Route -> cached / prompt tokens in the window (routes with prompt tokens only)."""
        self._trim()
        prompt: dict[str, int] = defaultdict(int)
        cached: dict[str, int] = defaultdict(int)
        for s in self._samples:
            prompt[s.route] += s.prompt_tokens
            cached[s.route] += s.cached_tokens
        return {r: cached[r] / p for r, p in prompt.items() if p > 0}

    def cost_per_1m(
        self, pool_usd_per_hour: Mapping[str, float], pool_replicas: Mapping[str, int]
    ) -> dict[str, float]:
        """Route -> USD per 1M tokens in the window (see the module docstring for the formula)."""
        self._trim()
        # The window is shorter than window_s until the gateway has run that long.
        window = min(self.window_s, max(1e-9, self._clock() - self._started))
        busy_by_pool: dict[str, float] = defaultdict(float)
        busy: dict[tuple[str, str], float] = defaultdict(float)
        tokens: dict[str, int] = defaultdict(int)
        for s in self._samples:
            busy_by_pool[s.pool] += s.replica_seconds
            busy[(s.route, s.pool)] += s.replica_seconds
            tokens[s.route] += s.prompt_tokens + s.completion_tokens
        usd: dict[str, float] = defaultdict(float)
        for (route, pool), seconds in busy.items():
            price = pool_usd_per_hour.get(pool)
            if price is None or busy_by_pool[pool] <= 0:
                continue
            bill = price / 3600.0 * pool_replicas.get(pool, 1) * window
            usd[route] += bill * seconds / busy_by_pool[pool]
        return {r: usd[r] / tokens[r] * 1e6 for r in usd if tokens[r] > 0}
