"""Which replica made a stored response: ``previous_response_id`` must go back there.

vLLM keeps a ``/v1/responses`` answer (and the conversation behind it) in the memory of the
engine that produced it; a follow-up with ``previous_response_id`` sent anywhere else gets a 404.
So the gateway records, for each response it forwards, the replica that answered it and the
tenant that asked, and routes follow-ups (and ``GET /v1/responses/{id}``) there.

One gateway keeps the map in memory; gateways sharing Redis keep it there, so a follow-up may
reach any of them. Entries expire after ``ttl_s`` (a day by default: a stored response outlives
no engine restart anyway).

With Redis, each gateway also keeps what it recorded itself in memory (an entry never changes:
a response id is made once), so it finds its own responses without asking Redis, and through a
Redis outage. What it could not write during an outage is written once Redis answers again, so
other gateways find those responses too. A response this gateway does not know, while Redis
cannot be read, raises ``ResponseAffinityUnavailable``: the client is told to retry (a 503),
not that the response does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
#: After a failed Redis call, how long Redis is left alone: a hung Redis would otherwise cost
#: every Responses request the client's timeout.
OUTAGE_S = 5.0
#: Entries written per round trip when an outage's backlog goes out.
BACKLOG_BATCH = 1000


@dataclass(frozen=True, slots=True)
class ResponseHome:
    """Where a response lives, and whose it is (a tenant may only continue its own)."""

    replica: ReplicaId
    tenant: str


class ResponseAffinityUnavailable(Exception):
    """The shared map cannot be read and this gateway did not record the response itself."""


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
    """The map in Redis (``<prefix>response:<id>`` -> JSON, with a TTL), shared by gateways, and
    this gateway's own entries in memory as well (see the module's docstring)."""

    def __init__(
        self,
        redis_url: str,
        key_prefix: str = "fleetgate:",
        ttl_s: float = DEFAULT_TTL_S,
        capacity: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from routing.redis_clients import bounded_client

        self._redis = bounded_client(redis_url, 0.5)
        self._prefix = f"{key_prefix}response:"
        self._ttl_s = ttl_s
        self._clock = clock
        self._own = MemoryResponseAffinity(ttl_s, capacity, clock)
        #: Recorded while Redis failed, oldest first: (when, home), written once it answers.
        self._unwritten: OrderedDict[str, tuple[float, ResponseHome]] = OrderedDict()
        self._capacity = capacity
        #: In an outage: its failures are logged once, not once per request.
        self._failing = False
        #: After a failure, Redis is left alone this long (``OUTAGE_S``).
        self.outage_s = OUTAGE_S
        self._skip_until = float("-inf")
        #: Writes the outage's backlog once Redis answers (``_write_backlog``).
        self._writer: asyncio.Task[None] | None = None

    async def remember(self, response_id: str, home: ResponseHome) -> None:
        await self._own.remember(response_id, home)
        if self._failing:  # in an outage: kept for the backlog writer, Redis left alone
            self._keep_unwritten(response_id, home)
            return
        try:
            await self._redis.set(
                self._prefix + response_id, _encode(home), px=int(self._ttl_s * 1000)
            )
        except Exception as exc:  # kept: this gateway still finds it, others once written
            self._keep_unwritten(response_id, home)
            self._failed(exc)

    async def home_of(self, response_id: str) -> ResponseHome | None:
        own = await self._own.home_of(response_id)
        if own is not None:
            return own
        if self._clock() < self._skip_until:
            raise ResponseAffinityUnavailable(f"Redis failed less than {self.outage_s:g} s ago")
        try:
            raw = await self._redis.get(self._prefix + response_id)
        except Exception as exc:
            self._failed(exc)
            raise ResponseAffinityUnavailable(str(exc) or type(exc).__name__) from exc
        if raw is None:
            return None
        try:
            entry = json.loads(raw)
            return ResponseHome(ReplicaId(str(entry["replica"])), str(entry["tenant"]))
        except (ValueError, KeyError, TypeError):
            log.warning("response affinity: malformed entry for %s", response_id)
            return None

    def _keep_unwritten(self, response_id: str, home: ResponseHome) -> None:
        self._unwritten[response_id] = (self._clock(), home)
        while len(self._unwritten) > self._capacity:
            self._unwritten.popitem(last=False)

    def _failed(self, exc: BaseException) -> None:
        self._skip_until = self._clock() + self.outage_s
        if not self._failing:
            self._failing = True
            log.warning(
                "response affinity: Redis failed (%s): this gateway's responses are kept in its "
                "memory and written once Redis answers; follow-ups of other gateways' responses "
                "get 503 until then", exc,
            )
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_backlog())

    async def _write_backlog(self) -> None:
        """Every ``outage_s``, try to write what the outage kept back, in batches (a long
        outage's backlog must not stall the event loop in one pipeline); done once it is all
        written, whether or not any request comes."""
        while self._failing:
            await asyncio.sleep(max(0.0, self._skip_until - self._clock()))
            written = 0
            try:
                while self._unwritten:
                    batch = list(itertools.islice(self._unwritten.items(), BACKLOG_BATCH))
                    now = self._clock()
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for response_id, (at, home) in batch:
                            left_ms = int((self._ttl_s - (now - at)) * 1000)
                            if left_ms > 0:
                                pipe.set(self._prefix + response_id, _encode(home), px=left_ms)
                        await pipe.execute()
                    for response_id, _ in batch:
                        self._unwritten.pop(response_id, None)
                    written += len(batch)
            except Exception as exc:
                self._skip_until = self._clock() + self.outage_s
                log.debug("response affinity: backlog write failed: %s", exc)
                continue
            self._failing = False
            self._skip_until = float("-inf")
            log.warning(
                "response affinity: Redis answers again; wrote %d responses recorded during "
                "the outage", written,
            )

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        await self._redis.aclose()


def _encode(home: ResponseHome) -> str:
    """A home as Redis keeps it (``home_of`` reads it back)."""
    return json.dumps({"replica": home.replica, "tenant": home.tenant})


def build_response_affinity(redis_url: str | None, key_prefix: str = "fleetgate:") -> (
    ResponseAffinity
):
    """Redis-backed when the gateway runs with Redis, else in memory."""
    if redis_url:
        return RedisResponseAffinity(redis_url, key_prefix)
    return MemoryResponseAffinity()
