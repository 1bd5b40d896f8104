"""In-flight load per replica: requests and not-yet-prefilled prompt tokens.

One gateway counts in memory. Several gateways share counts through Redis: each publishes its own
counts under its own key with a short TTL (so a crashed gateway's counts vanish by themselves) and
reads the sum of all gateways' keys. Publishing is periodic, never on the request path, so Redis
being slow or down costs a little freshness and no latency.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections import defaultdict
from typing import Protocol

from routing.types import ReplicaId

log = logging.getLogger(__name__)

Counts = dict[ReplicaId, tuple[int, int]]


class InflightTracker(Protocol):
    """Counts requests in flight per replica."""

    def start(self, replica: ReplicaId, prefill_tokens: int) -> None: ...

    def prefilled(self, replica: ReplicaId, prefill_tokens: int) -> None: ...

    def finish(self, replica: ReplicaId, prefill_tokens: int) -> None: ...

    def counts(self) -> Counts: ...

    async def sync(self) -> None: ...

    async def close(self) -> None: ...


class MemoryInflight:
    """This gateway's own counts."""

    def __init__(self) -> None:
        self._requests: dict[ReplicaId, int] = defaultdict(int)
        self._tokens: dict[ReplicaId, int] = defaultdict(int)

    def start(self, replica: ReplicaId, prefill_tokens: int) -> None:
        """A request was sent to ``replica``; its prompt is not prefilled yet."""
        self._requests[replica] += 1
        self._tokens[replica] += prefill_tokens

    def prefilled(self, replica: ReplicaId, prefill_tokens: int) -> None:
        """The first byte arrived: the engine has prefilled the prompt."""
        self._tokens[replica] = max(0, self._tokens[replica] - prefill_tokens)

    def finish(self, replica: ReplicaId, prefill_tokens: int) -> None:
        """The request ended; ``prefill_tokens`` is what is still counted as unprefilled (or 0)."""
        self._requests[replica] = max(0, self._requests[replica] - 1)
        self._tokens[replica] = max(0, self._tokens[replica] - prefill_tokens)

    def counts(self) -> Counts:
        return {r: (n, self._tokens[r]) for r, n in self._requests.items()}

    async def sync(self) -> None:
        return None

    async def close(self) -> None:
        return None


class RedisInflight(MemoryInflight):
    """Local counts plus the other gateways' counts, shared through Redis."""

    KEY_PREFIX = "fleetgate:inflight:"

    def __init__(self, redis_url: str, ttl_s: float = 5.0, gateway_id: str | None = None) -> None:
        super().__init__()
        import redis.asyncio as redis_asyncio

        self._redis = redis_asyncio.Redis.from_url(redis_url, socket_timeout=0.5)
        self._ttl_ms = int(ttl_s * 1000)
        self.gateway_id = gateway_id or uuid.uuid4().hex
        self._others: Counts = {}

    def counts(self) -> Counts:
        own = super().counts()
        merged: dict[ReplicaId, tuple[int, int]] = dict(self._others)
        for rid, (n, t) in own.items():
            on, ot = merged.get(rid, (0, 0))
            merged[rid] = (on + n, ot + t)
        return merged

    async def sync(self) -> None:
        """Publish our counts and read everyone else's; errors only cost freshness."""
        own_key = self.KEY_PREFIX + self.gateway_id
        try:
            await self._redis.set(own_key, json.dumps(super().counts()), px=self._ttl_ms)
            others: dict[ReplicaId, tuple[int, int]] = {}
            async for key in self._redis.scan_iter(match=self.KEY_PREFIX + "*", count=100):
                name = key.decode() if isinstance(key, bytes) else key
                if name == own_key:
                    continue
                raw = await self._redis.get(key)
                if raw is None:
                    continue
                for rid, (n, t) in json.loads(raw).items():
                    on, ot = others.get(ReplicaId(rid), (0, 0))
                    others[ReplicaId(rid)] = (on + int(n), ot + int(t))
            self._others = others
        except Exception as exc:  # redis errors, bad JSON from a foreign key
            log.warning("in-flight sync through Redis failed: %s", exc)

    async def close(self) -> None:
        # Shutting down: a failed delete is harmless, the key expires by itself.
        with contextlib.suppress(Exception):
            await self._redis.delete(self.KEY_PREFIX + self.gateway_id)
        await self._redis.aclose()
