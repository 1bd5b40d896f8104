"""Per-tenant token buckets (this gateway's share; limits are per gateway process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """``requests_per_s`` sustained, ``burst`` at once, per tenant name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, tenant: str, requests_per_s: float | None, burst: int) -> float | None:
        """Take one token; None if allowed, else seconds until one is available."""
        if requests_per_s is None:
            return None
        now = self._clock()
        bucket = self._buckets.setdefault(tenant, _Bucket(float(burst), now))
        bucket.tokens = min(float(burst), bucket.tokens + (now - bucket.updated) * requests_per_s)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / requests_per_s
