"""Which replica made a stored response: ``previous_response_id`` must go back there.

vLLM keeps a ``/v1/responses`` answer (and the conversation behind it) in the memory of the
engine that produced it; a follow-up with ``previous_response_id`` sent anywhere else gets a 404.
So the gateway records, for each response it forwards, the replica that answered it and the
tenant that asked, and routes follow-ups (and ``GET /v1/responses/{id}``) there.

One gateway keeps the map in memory; gateways sharing Redis keep it there, so a follow-up may
reach any of them. Entries expire after ``ttl_s`` (a day by default: a stored response outlives
no engine restart anyway). A Redis failure is logged and treated as "not known": the caller then
answers a clear error rather than guessing a replica.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from routing.types import ReplicaId

log = logging.getLogger(__name__)

#: How long a response's replica is remembered.
DEFAULT_TTL_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ResponseHome:
    """Where a response lives, and whose it is (a tenant may only continue its own)."""

    replica: ReplicaId
    tenant: str


class ResponseAffinity(Protocol):
    """response id -> ``ResponseHome``."""

    async def remember(self, response_id: str, home: ResponseHome) -> None: ...

    async def home_of(self, response_id: str) -> ResponseHome | None: ...

    async def close(self) -> None: ...


class MemoryResponseAffinity:
    """One gateway's map, bounded (oldest dropped first) and expiring after ``ttl_s``."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        capacity: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._clock = clock
        self._homes: OrderedDict[str, tuple[float, ResponseHome]] = OrderedDict()

    async def remember(self, response_id: str, home: ResponseHome) -> None:
        self._homes[response_id] = (self._clock() + self.ttl_s, home)
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    async def home_of(self, response_id: str) -> ResponseHome | None:
        entry = self._homes.get(response_id)
        if entry is None:
            return None
        expires, home = entry
        if self._clock() >= expires:
            del self._homes[response_id]
            return None
        return home

    async def close(self) -> None:
        return None


class RedisResponseAffinity:
    """The map in Redis (``<prefix>response:<id>`` -> JSON, with a TTL), shared by gateways."""

    def __init__(
        self, redis_url: str, key_prefix: str = "fleetgate:", ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        from routing.redis_clients import bounded_client

        self._redis = bounded_client(redis_url, 0.5)
        self._prefix = f"{key_prefix}response:"
        self._ttl_ms = int(ttl_s * 1000)

    async def remember(self, response_id: str, home: ResponseHome) -> None:
        value = json.dumps({"replica": home.replica, "tenant": home.tenant})
        try:
            await self._redis.set(self._prefix + response_id, value, px=self._ttl_ms)
        except Exception as exc:  # the follow-up will get a clear error; serving goes on
            log.warning("response affinity: cannot record %s in Redis: %s", response_id, exc)

    async def home_of(self, response_id: str) -> ResponseHome | None:
        try:
            raw = await self._redis.get(self._prefix + response_id)
        except Exception as exc:
            log.warning("response affinity: cannot read %s from Redis: %s", response_id, exc)
            return None
        if raw is None:
            return None
        try:
            entry = json.loads(raw)
            return ResponseHome(ReplicaId(str(entry["replica"])), str(entry["tenant"]))
        except (ValueError, KeyError, TypeError):
            log.warning("response affinity: malformed entry for %s", response_id)
            return None

    async def close(self) -> None:
        await self._redis.aclose()


def build_response_affinity(redis_url: str | None, key_prefix: str = "fleetgate:") -> (
    ResponseAffinity
):
    """Redis-backed when the gateway runs with Redis, else in memory."""
    if redis_url:
        return RedisResponseAffinity(redis_url, key_prefix)
    return MemoryResponseAffinity()
