"""Where replicas announce themselves: one ``ReplicaState`` per replica, kept alive by heartbeat.

The replica agent writes its replica's state every scrape (``publish``) with a short TTL; gateways
read ``list_replicas()`` for discovery and load. A replica whose agent dies simply expires: no
deregistration step can be forgotten. Two backends with one behaviour:

* ``RedisFleetStore`` for production (many gateways, many agents): ``<prefix>replica:<id>`` holds
  the state as JSON with a millisecond TTL; ``<prefix>replicas`` is a set of ids used for listing
  (ids whose key has expired are pruned lazily by readers).
* ``MemoryFleetStore`` for ``fleetgate up`` and tests, with an injectable clock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from routing.redis_urls import PRIMARY_URL_PREFIXES
from routing.state import MAX_LIFETIME_COUNT, MAX_REQUEST_COUNT, ReplicaState
from routing.types import Epoch, ReplicaId

__all__ = [
    "FleetStore",
    "FleetStoreUnavailable",
    "MemoryFleetStore",
    "RedisFleetStore",
    "build_fleet_store",
    "state_from_json",
    "state_to_json",
]

_FROZENSET_FIELDS = {
    f.name for f in dataclasses.fields(ReplicaState) if str(f.type).startswith("frozenset")
}
_FIELD_NAMES = {f.name for f in dataclasses.fields(ReplicaState)}

log = logging.getLogger(__name__)

#: The numbers a state carries, and the most each can be: a stored state with one out of range
#: (a corrupt or foreign writer) is refused whole rather than taken into routing, where one
#: request count past 2**63 overflowed the fleet's arrays (the routing review, session 46).
_BOUNDS: dict[str, float] = {
    **dict.fromkeys(("running", "waiting", "inflight_requests"), MAX_REQUEST_COUNT),
    **dict.fromkeys(
        (
            "block_size",
            "kv_capacity_blocks",
            "cached_blocks",
            "preemptions_total",
            "max_loras",
            "max_cpu_loras",
            "max_model_len",
            "inflight_prefill_tokens",
            "inflight_unprefilled",
            "finished_since_read",
        ),
        MAX_LIFETIME_COUNT,
    ),
    **dict.fromkeys(
        ("kv_usage", "prefill_tokens_per_s", "decode_step_ms", "decode_itl_ms", "metrics_read_at"),
        math.inf,
    ),
}


def _check_figures(kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` for a figure that is not a finite number within its bound (an
    integer where the field counts); None stands where the field may be unknown."""
    for name, bound in _BOUNDS.items():
        value = kwargs.get(name)
        if value is None:
            continue
        counts = bound is not math.inf
        if isinstance(value, bool) or not isinstance(value, int if counts else (int, float)):
            raise ValueError(f"replica state: {name} is {value!r}, not a number")
        if not (0 <= value <= bound):  # NaN and infinities fail it too
            raise ValueError(f"replica state: {name} is {value!r}, out of range")


class FleetStoreUnavailable(RuntimeError):
    """The store could not be reached (Redis down); callers keep going and retry later."""


def state_to_json(state: ReplicaState) -> str:
    """Serialise a ``ReplicaState`` (frozensets become sorted lists, so output is stable)."""
    data: dict[str, Any] = dataclasses.asdict(state)
    for name in _FROZENSET_FIELDS:
        data[name] = sorted(data[name])
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def state_from_json(raw: str | bytes) -> ReplicaState:
    """Parse what ``state_to_json`` wrote. Unknown keys (a newer writer) are ignored."""
    data = json.loads(raw)
    if not isinstance(data, dict) or "replica_id" not in data or "url" not in data:
        raise ValueError(f"not a replica state: {str(raw)[:200]!r}")
    kwargs = {k: v for k, v in data.items() if k in _FIELD_NAMES}
    _check_figures(kwargs)
    for name in _FROZENSET_FIELDS & kwargs.keys():
        kwargs[name] = frozenset(kwargs[name])
    kwargs["replica_id"] = ReplicaId(kwargs["replica_id"])
    kwargs["epoch"] = Epoch(int(kwargs.get("epoch", 0)))
    return ReplicaState(**kwargs)


#: How long a deliberate removal is remembered, for gateways to tell it from an expired heartbeat.
DEPARTED_TTL_S = 3600.0


def states_from_json(raws: Iterable[str | bytes], skipped: set[str]) -> list[ReplicaState]:
    """Each stored state that parses; one that does not is left out (and said once, while it
    is there: ``skipped`` remembers the ones said), so that one bad entry neither hides the
    fleet's other replicas nor reaches routing."""
    states, bad = [], set()
    for raw in raws:
        try:
            states.append(state_from_json(raw))
        except (ValueError, TypeError, KeyError) as exc:
            said = str(exc)[:300]
            bad.add(said)
            if said not in skipped:
                log.warning("fleet store: a replica entry left out: %s", said)
    # The ones there now: one that went away is said again should it come back.
    skipped.clear()
    skipped.update(bad)
    return states


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0 (got {ttl_s!r})")


@runtime_checkable
class FleetStore(Protocol):
    """The replica registry that agents write and gateways read."""

    async def register(self, state: ReplicaState, ttl_s: float) -> None:
        """Announce a replica (first start, or a new epoch after a restart)."""
        ...

    async def publish(self, state: ReplicaState, ttl_s: float) -> None:
        """Refresh a replica's state and push its expiry ``ttl_s`` seconds out (heartbeat)."""
        ...

    async def list_replicas(self) -> list[ReplicaState]:
        """Every replica whose heartbeat has not expired, ordered by id."""
        ...

    async def remove(self, replica_id: ReplicaId) -> None:
        """Forget a replica now (clean shutdown) instead of waiting for its TTL."""
        ...

    async def departed(self) -> set[ReplicaId]:
        """Replicas removed on purpose (``remove``) in the last ``DEPARTED_TTL_S``: gateways drop
        them at once, while one whose heartbeat merely expired is kept as long as it answers
        (its agent may be down, or Redis refusing writes)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class MemoryFleetStore:
    """In-process ``FleetStore``; ``clock`` (default ``time.monotonic``) drives expiry."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[ReplicaId, tuple[float, str]] = {}
        self._departed: dict[ReplicaId, float] = {}
        #: Stored entries left out as unreadable, already said (``states_from_json``).
        self._skipped: set[str] = set()

    async def register(self, state: ReplicaState, ttl_s: float) -> None:
        await self.publish(state, ttl_s)
        self._departed.pop(state.replica_id, None)

    async def publish(self, state: ReplicaState, ttl_s: float) -> None:
        _check_ttl(ttl_s)
        # Store the serialised form so readers get copies, exactly as from Redis.
        self._states[state.replica_id] = (self._clock() + ttl_s, state_to_json(state))

    async def list_replicas(self) -> list[ReplicaState]:
        now = self._clock()
        for rid in [rid for rid, (expires, _) in self._states.items() if expires <= now]:
            del self._states[rid]
        stored = (raw for _, (_, raw) in sorted(self._states.items()))
        return states_from_json(stored, self._skipped)

    async def remove(self, replica_id: ReplicaId) -> None:
        self._states.pop(replica_id, None)
        self._departed[replica_id] = self._clock() + DEPARTED_TTL_S

    async def departed(self) -> set[ReplicaId]:
        now = self._clock()
        return {rid for rid, until in self._departed.items() if until > now}

    async def close(self) -> None:
        return None


class RedisFleetStore:
    """``FleetStore`` in Redis, shared by every gateway and agent of a fleet."""

    def __init__(
        self,
        url: str,
        key_prefix: str = "fleetgate:",
        socket_timeout_s: float = 1.0,
        client: Any | None = None,
    ) -> None:
        from routing.redis_clients import bounded_client

        self._redis = client or bounded_client(url, socket_timeout_s)
        self._prefix = key_prefix
        self._set_key = f"{key_prefix}replicas"
        self._departed_key = f"{key_prefix}replicas-departed"
        #: Stored entries left out as unreadable, already said (``states_from_json``).
        self._skipped: set[str] = set()

    def _key(self, replica_id: str) -> str:
        return f"{self._prefix}replica:{replica_id}"

    async def register(self, state: ReplicaState, ttl_s: float) -> None:
        await self.publish(state, ttl_s)
        try:  # back in the fleet: an earlier clean stop no longer marks it as gone
            await self._redis.zrem(self._departed_key, state.replica_id)
        except Exception as exc:
            raise FleetStoreUnavailable(f"fleet store write failed: {exc}") from exc

    async def publish(self, state: ReplicaState, ttl_s: float) -> None:
        _check_ttl(ttl_s)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._key(state.replica_id), state_to_json(state), px=int(ttl_s * 1000))
                pipe.sadd(self._set_key, state.replica_id)
                await pipe.execute()
        except Exception as exc:  # redis raises many connection error types; all mean "down"
            raise FleetStoreUnavailable(f"fleet store write failed: {exc}") from exc

    async def list_replicas(self) -> list[ReplicaState]:
        try:
            ids = sorted(m.decode() if isinstance(m, bytes) else m
                         for m in await self._redis.smembers(self._set_key))
            if not ids:
                return []
            raws = await self._redis.mget([self._key(rid) for rid in ids])
            expired = [rid for rid, raw in zip(ids, raws, strict=True) if raw is None]
            if expired:
                # The key's TTL is the truth; the set only lists candidates, so prune it here.
                await self._redis.srem(self._set_key, *expired)
        except Exception as exc:
            raise FleetStoreUnavailable(f"fleet store read failed: {exc}") from exc
        return states_from_json((raw for raw in raws if raw is not None), self._skipped)

    async def remove(self, replica_id: ReplicaId) -> None:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self._key(replica_id))
                pipe.srem(self._set_key, replica_id)
                # One sorted set, scored by when the mark expires: read in one round trip
                # whatever else the Redis holds (a SCAN over a shared keyspace took seconds).
                pipe.zadd(self._departed_key, {replica_id: time.time() + DEPARTED_TTL_S})
                await pipe.execute()
        except Exception as exc:
            raise FleetStoreUnavailable(f"fleet store remove failed: {exc}") from exc

    async def departed(self) -> set[ReplicaId]:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(self._departed_key, "-inf", time.time())
                pipe.zrange(self._departed_key, 0, -1)
                _, members = await pipe.execute()
        except Exception as exc:
            raise FleetStoreUnavailable(f"fleet store read failed: {exc}") from exc
        return {ReplicaId(m.decode() if isinstance(m, bytes) else m) for m in members}

    async def close(self) -> None:
        await self._redis.aclose()


def build_fleet_store(url: str | None, key_prefix: str = "fleetgate:") -> FleetStore:
    """``RedisFleetStore`` for a ``redis://``/``rediss://``/``unix://`` or Sentinel URL, memory
    for None/``memory://``."""
    if url is None or url in ("memory", "memory://"):
        return MemoryFleetStore()
    if url.startswith(PRIMARY_URL_PREFIXES):
        return RedisFleetStore(url, key_prefix=key_prefix)
    # Imported here: at module level it would load the whole policy-config package into
    # every agent at start-up, for an error path.
    from routing.config.errors import describe_value  # the URL's password stays out

    raise ValueError(
        "fleet store URL must be redis://, rediss://, unix://, redis+sentinel:// (a Sentinel "
        "group: routing/redis_sentinel.py) or memory:// "
        f"(got {describe_value(url)})"
    )
