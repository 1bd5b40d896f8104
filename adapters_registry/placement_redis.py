"""Placement store in Redis, so every gateway sees the same slots, locks and in-flight counts.

Keys (``prefix`` defaults to ``fleetgate:``; ``|`` separates names because adapter names may
contain ``:`` and ``/`` but never ``|``):

- ``{prefix}adapters:res|{replica}`` — hash adapter -> JSON ``[resident 0/1, changed_at,
  last_used]``
- ``{prefix}adapters:src|{replica}`` — hash adapter -> the ``source`` a gateway loaded it from,
  while resident (absent: none recorded). A hash of its own, not a fourth element of the
  ``res`` entry: gateways of the previous release read those entries as three elements, and
  must go on doing so during a rolling upgrade
- ``{prefix}adapters:use|{replica}|{adapter}`` — sorted set of request leases, score = expiry,
  so a gateway that dies mid-request stops holding the adapter once its leases expire
- ``{prefix}adapters:lock|{replica}|{adapter}`` — the load/unload lock (``SET NX PX``)
- ``{prefix}adapters:loads|{replica}`` — sorted set of load times (the thrash guard's window)
- ``{prefix}adapters:traffic`` — hash ``{bucket}|{gateway}|{adapter}`` -> requests, each
  gateway's pre-warm traffic (``shared_traffic.py``); one key, so a Redis Cluster keeps it on
  one node

Read-modify-write steps run as Lua scripts so two gateways cannot interleave them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

from adapters_registry.placement import (
    AdapterStatus,
    PlacementUnavailable,
    ReplicaPlacement,
    Residency,
)
from routing.redis_clients import bounded_client
from routing.types import ReplicaId

T = TypeVar("T")

#: Bound of one placement-store call (a LoRA request and the registry's refresh wait on it).
DEFAULT_TIMEOUT_S = 1.0

# KEYS[1] res hash, KEYS[2] src hash; ARGV: adapter, resident (0/1), now, source ('' for none).
# A load counts as a use; an unload keeps it.
_MARK = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
local now = tonumber(ARGV[3])
local last = now
if ARGV[2] == '0' then
  last = 0
  if old then last = cjson.decode(old)[3] end
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({tonumber(ARGV[2]), now, last}))
if ARGV[2] == '1' and ARGV[4] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
else
  redis.call('HDEL', KEYS[2], ARGV[1])
end
"""

# KEYS[1] hash; ARGV: adapter, now. Only resident entries are touched.
_TOUCH = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
local e = cjson.decode(old)
if e[1] ~= 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({1, e[2], tonumber(ARGV[2])}))
return 1
"""

# KEYS[1] res hash, KEYS[2] src hash; ARGV: cutoff, read_at, engine-resident adapters... (see
# merge_engine_report). An entry the engine's report makes resident again, or drops, loses its
# recorded source: which weights the engine holds is unknown then.
_SYNC = """
local cutoff = tonumber(ARGV[1])
local read_at = tonumber(ARGV[2])
local engine = {}
for i = 3, #ARGV do engine[ARGV[i]] = true end
local all = redis.call('HGETALL', KEYS[1])
local seen = {}
for i = 1, #all, 2 do
  local name = all[i]
  local e = cjson.decode(all[i + 1])
  seen[name] = true
  if e[2] >= cutoff then
    -- newer than the report: keep what the gateways recorded
  elseif engine[name] then
    if e[1] ~= 1 then
      redis.call('HSET', KEYS[1], name, cjson.encode({1, read_at, e[3]}))
      redis.call('HDEL', KEYS[2], name)
    end
  else
    redis.call('HDEL', KEYS[1], name)
    redis.call('HDEL', KEYS[2], name)
  end
end
for name, _ in pairs(engine) do
  if not seen[name] then
    redis.call('HSET', KEYS[1], name, cjson.encode({1, read_at, 0}))
    redis.call('HDEL', KEYS[2], name)
  end
end
"""

# KEYS[1] res hash, KEYS[2] src hash; ARGV: adapter, source. Records a source for a resident
# copy that has none, leaving its entry (times, eviction order) as it is.
_SOURCE_IF_UNKNOWN = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw or cjson.decode(raw)[1] ~= 1 then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# KEYS[1] lock; ARGV[1] owner. Delete only our own lock, never one that expired and was retaken.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _text(value: str | bytes) -> str:
    # Works with clients created with or without ``decode_responses``.
    return value.decode() if isinstance(value, bytes) else value


def _residency(raw: str | bytes, source: str | bytes | None) -> Residency:
    """A ``res`` hash value (``[resident, changed_at, last_used]``) and its ``src`` value."""
    resident, changed_at, last_used = json.loads(raw)[:3]
    recorded = _text(source) if source and resident == 1 else None
    return Residency(resident == 1, float(changed_at), float(last_used), recorded)


class RedisPlacementStore:
    """``PlacementStore`` in Redis (``redis.asyncio``). Errors become ``PlacementUnavailable``."""

    backend = "redis"

    def __init__(
        self,
        redis: Redis,
        key_prefix: str = "fleetgate:",
        clock: Callable[[], float] = time.time,
        owns_client: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._redis = redis
        #: Bound of one store call, retries included: a LoRA request waits on these calls.
        self._timeout_s = timeout_s
        self._prefix = key_prefix
        # Lease expiry is compared across gateways, so it uses wall-clock time.
        self._clock = clock
        self._owns_client = owns_client
        self._mark = redis.register_script(_MARK)
        self._touch = redis.register_script(_TOUCH)
        self._sync = redis.register_script(_SYNC)
        self._unlock = redis.register_script(_UNLOCK)
        self._source_if_unknown = redis.register_script(_SOURCE_IF_UNKNOWN)

    @classmethod
    def from_url(
        cls, url: str, key_prefix: str = "fleetgate:", timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> RedisPlacementStore:
        """A store with its own client (closed by ``close``), bounded by ``timeout_s``."""
        client = bounded_client(url, timeout_s, decode_responses=True)
        return cls(client, key_prefix, owns_client=True, timeout_s=timeout_s)

    # ------------------------------------------------------------------ keys

    def _res(self, replica: ReplicaId) -> str:
        return f"{self._prefix}adapters:res|{replica}"

    def _src(self, replica: ReplicaId) -> str:
        return f"{self._prefix}adapters:src|{replica}"

    def _res_src(self, replica: ReplicaId) -> list[str]:
        """The two hashes a residency write updates together, in one script."""
        return [self._res(replica), self._src(replica)]

    def _use(self, replica: ReplicaId, adapter: str) -> str:
        return f"{self._prefix}adapters:use|{replica}|{adapter}"

    def lock_key(self, replica: ReplicaId, adapter: str) -> str:
        """The Redis key of the (replica, adapter) load/unload lock."""
        return f"{self._prefix}adapters:lock|{replica}|{adapter}"

    def _loads(self, replica: ReplicaId) -> str:
        return f"{self._prefix}adapters:loads|{replica}"

    def _traffic(self) -> str:
        return f"{self._prefix}adapters:traffic"

    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await op()
        except TimeoutError as exc:
            raise PlacementUnavailable(
                f"adapter placement store ({what}): no answer within {self._timeout_s:g} s"
            ) from exc
        except (RedisError, OSError) as exc:
            raise PlacementUnavailable(f"adapter placement store ({what}): {exc}") from exc

    # ------------------------------------------------------------------ reads

    async def status(self, replica: ReplicaId, adapter: str) -> AdapterStatus:
        async def op() -> AdapterStatus:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hget(self._res(replica), adapter)
                pipe.hget(self._src(replica), adapter)
                pipe.exists(self.lock_key(replica, adapter))
                raw, source, locked = await pipe.execute()
            entry = _residency(raw, source) if raw is not None else None
            return AdapterStatus(
                resident=entry is not None and entry.resident,
                busy=bool(locked),
                source=entry.source if entry is not None else None,
            )

        return await self._call("status", op)

    async def snapshot(self, replica: ReplicaId, loads_since: float) -> ReplicaPlacement:
        async def op() -> ReplicaPlacement:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self._res(replica))
                pipe.hgetall(self._src(replica))
                raw, raw_sources = await pipe.execute()
            sources = {_text(name): value for name, value in raw_sources.items()}
            entries = {}
            for name, value in raw.items():
                entries[_text(name)] = _residency(value, sources.get(_text(name)))
            now = self._clock()
            async with self._redis.pipeline(transaction=False) as pipe:
                for name in entries:
                    # Exclusive bound: a lease whose expiry is exactly now has expired.
                    pipe.zcount(self._use(replica, name), f"({now}", "+inf")
                pipe.zrangebyscore(self._loads(replica), loads_since, "+inf", withscores=True)
                results: list[Any] = await pipe.execute()
            inflight = {
                name: int(n) for name, n in zip(entries, results[:-1], strict=True) if int(n) > 0
            }
            loads = tuple(sorted(score for _, score in results[-1]))
            return ReplicaPlacement(replica, entries, inflight, loads)

        return await self._call("snapshot", op)

    # ------------------------------------------------------------------ writes

    async def mark_resident(
        self, replica: ReplicaId, adapter: str, now: float, source: str | None = None
    ) -> None:
        args = [adapter, 1, now, source or ""]
        await self._call("mark", lambda: self._mark(keys=self._res_src(replica), args=args))

    async def mark_unloaded(self, replica: ReplicaId, adapter: str, now: float) -> None:
        await self._call(
            "mark", lambda: self._mark(keys=self._res_src(replica), args=[adapter, 0, now, ""])
        )

    async def record_source_if_unknown(
        self, replica: ReplicaId, adapter: str, source: str
    ) -> bool:
        recorded = await self._call(
            "source",
            lambda: self._source_if_unknown(keys=self._res_src(replica), args=[adapter, source]),
        )
        return bool(recorded)

    async def touch(self, replica: ReplicaId, adapter: str, now: float) -> None:
        await self._call(
            "touch", lambda: self._touch(keys=[self._res(replica)], args=[adapter, now])
        )

    async def sync_from_engine(
        self, replica: ReplicaId, engine_resident: Collection[str], read_at: float, grace_s: float
    ) -> None:
        args: list[Any] = [read_at - grace_s, read_at, *sorted(engine_resident)]
        await self._call("sync", lambda: self._sync(keys=self._res_src(replica), args=args))

    async def begin_use(self, replica: ReplicaId, adapter: str, lease: str, ttl_s: float) -> None:
        key = self._use(replica, adapter)
        now = self._clock()

        async def op() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(key, "-inf", now)
                pipe.zadd(key, {lease: now + ttl_s})
                pipe.expire(key, max(1, int(ttl_s) + 1))
                await pipe.execute()

        await self._call("begin_use", op)

    async def end_use(self, replica: ReplicaId, adapter: str, lease: str) -> None:
        await self._call("end_use", lambda: self._redis.zrem(self._use(replica, adapter), lease))

    async def leases(self, replica: ReplicaId, adapter: str) -> list[str]:
        now = self._clock()
        raw = await self._call(
            "leases",
            lambda: self._redis.zrangebyscore(self._use(replica, adapter), f"({now}", "+inf"),
        )
        return sorted(_text(lease) for lease in raw)

    async def try_lock(self, replica: ReplicaId, adapter: str, owner: str, ttl_s: float) -> bool:
        px = max(1, int(ttl_s * 1000))
        result = await self._call(
            "lock",
            lambda: self._redis.set(self.lock_key(replica, adapter), owner, nx=True, px=px),
        )
        return bool(result)

    async def unlock(self, replica: ReplicaId, adapter: str, owner: str) -> None:
        await self._call(
            "unlock", lambda: self._unlock(keys=[self.lock_key(replica, adapter)], args=[owner])
        )

    async def record_load(self, replica: ReplicaId, at: float, keep_s: float) -> None:
        key = self._loads(replica)

        async def op() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                # A unique member per load: two loads in the same instant both count.
                pipe.zadd(key, {f"{at}|{uuid.uuid4().hex[:8]}": at})
                pipe.zremrangebyscore(key, "-inf", at - keep_s)
                pipe.expire(key, max(1, int(keep_s) + 1))
                await pipe.execute()

        await self._call("record_load", op)

    async def forget_replica(self, replica: ReplicaId) -> None:
        async def op() -> None:
            keys = [self._res(replica), self._src(replica), self._loads(replica)]
            for pattern in (self._use(replica, "*"), self.lock_key(replica, "*")):
                keys += [k async for k in self._redis.scan_iter(match=pattern, count=500)]
            await self._redis.delete(*keys)

        await self._call("forget_replica", op)

    async def put_traffic(
        self, gateway: str, counts: Mapping[tuple[int, str], int], window_s: float
    ) -> None:
        async def op() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                if counts:
                    fields = {
                        f"{slot}|{gateway}|{adapter}": n for (slot, adapter), n in counts.items()
                    }
                    pipe.hset(self._traffic(), mapping=fields)
                # Gone once every gateway has stopped writing (two windows: none is cut short).
                pipe.pexpire(self._traffic(), int(2_000 * window_s))
                await pipe.execute()

        await self._call("put_traffic", op)

    async def traffic(self, oldest_slot: int, besides: str) -> dict[tuple[int, str], int]:
        async def op() -> dict[tuple[int, str], int]:
            raw = await self._redis.hgetall(self._traffic())
            counts: dict[tuple[int, str], int] = {}
            stale: list[str] = []
            for field, value in raw.items():
                name = _text(field)
                slot, gateway, adapter = name.split("|", 2)
                if int(slot) < oldest_slot:
                    stale.append(name)
                elif gateway != besides:
                    counts[(int(slot), adapter)] = counts.get((int(slot), adapter), 0) + int(value)
            if stale:  # out of the window: whichever gateway reads first drops them
                await self._redis.hdel(self._traffic(), *stale)
            return counts

        return await self._call("traffic", op)

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()
