"""``BlockIndex`` in Redis, shared by every gateway and replica agent of a fleet.

Each operation is one Lua script call: one round trip, atomic, and it reads the epoch table in
the same script, so a retired epoch stops matching for every gateway at once. All keys of one
index share the hash tag ``{<key_prefix>}`` and therefore one Redis Cluster slot (docs/index.md
explains why, and how to spread several indexes over shards).

Every Redis failure (connection refused, timeout, OOM refusal, ...) surfaces as
``IndexUnavailable`` after at most ``timeout_s``, so the engine can route on load alone.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from routing.contracts import IndexStats, IndexUnavailable
from routing.index import redis_scripts
from routing.index._redis_call import call_redis
from routing.index._validate import check_blocks, check_epoch, check_replica, check_ttl
from routing.redis_clients import bounded_client
from routing.redis_sentinel import PrimaryMoves
from routing.types import BlockHash, Epoch, ReplicaId

__all__ = ["RedisBlockIndex"]

_T = TypeVar("_T")
_FORBIDDEN_PREFIX_CHARS = frozenset("{}:* ?[]\\")


class RedisBlockIndex:
    """A ``BlockIndex`` stored in Redis (>= 7.0) under the hash tag ``{<key_prefix>}``.

    ``redis`` is a URL (the index then owns its client and closes it) or an existing
    ``redis.asyncio`` client (left open on ``close``). ``timeout_s`` bounds every call.
    ``block_ttl_s`` is how long a block key lives after its last write or hit; it bounds memory
    together with Redis' ``maxmemory-policy volatile-lru``. ``require_heartbeat`` makes replicas
    that never heartbeat match nothing.
    """

    def __init__(
        self,
        redis: str | aioredis.Redis,
        *,
        key_prefix: str = "fleetgate:",
        timeout_s: float = 0.1,
        block_ttl_s: float = 3600.0,
        require_heartbeat: bool = False,
        touch_on_match: bool = True,
    ) -> None:
        if not isinstance(key_prefix, str) or not key_prefix.rstrip(":"):
            raise ValueError(f"key_prefix must be a non-empty string (got {key_prefix!r})")
        # The policy schema and the fleet store write prefixes as "fleetgate:"; as a hash tag the
        # trailing separator is noise, so "fleetgate:" and "fleetgate" name the same index.
        key_prefix = key_prefix.rstrip(":")
        bad = sorted(set(key_prefix) & _FORBIDDEN_PREFIX_CHARS)
        if bad:
            raise ValueError(
                f"key_prefix must not contain {''.join(bad)!r}: it becomes a Redis hash tag "
                f"(got {key_prefix!r})"
            )
        check_ttl(timeout_s, "timeout_s", optional=False)
        check_ttl(block_ttl_s, "block_ttl_s", optional=False)
        self._timeout_s = float(timeout_s)
        self._block_ttl_ms = _to_ms(block_ttl_s)
        self._require_heartbeat = "1" if require_heartbeat else "0"
        self._touch_ms = str(self._block_ttl_ms) if touch_on_match else ""
        if isinstance(redis, str):
            # One immediate retry heals a pooled connection broken by a Redis restart; more
            # would only delay the fallback to load-only routing.
            self._client = bounded_client(redis, timeout_s, decode_responses=True)
            self._owns_client = True
        elif isinstance(redis, aioredis.Redis):
            self._client = redis
            self._owns_client = False
        else:
            raise TypeError(f"redis must be a URL or a redis.asyncio.Redis (got {redis!r})")
        self._primary_moved = PrimaryMoves()
        self.key_prefix = key_prefix
        tag = "{" + key_prefix + "}"
        self._epochs_key = f"{tag}:epochs"
        self._alive_key = f"{tag}:alive"
        self._block_key_prefix = f"{tag}:b:"
        # Incarnation slots (redis_scripts explains them): the scripts that change a live
        # incarnation take these five keys first.
        self._slot_keys = [
            self._epochs_key,
            f"{tag}:slots",
            f"{tag}:owners",
            f"{tag}:dead",
            f"{tag}:meta",
        ]
        self._match_keys = [f"{tag}:owners", self._alive_key, f"{tag}:meta"]
        # register_script loads each script on first use and again after NOSCRIPT (a restart,
        # SCRIPT FLUSH or a failover to a replica that never saw it).
        self._record = self._client.register_script(redis_scripts.RECORD)
        self._remove = self._client.register_script(redis_scripts.REMOVE)
        self._retire = self._client.register_script(redis_scripts.RETIRE)
        self._set_epoch = self._client.register_script(redis_scripts.SET_EPOCH)
        self._heartbeat = self._client.register_script(redis_scripts.HEARTBEAT)
        self._match = self._client.register_script(redis_scripts.MATCH)

    def block_key(self, block: BlockHash) -> str:
        """The Redis key of one block (documented layout; useful to operators and tests)."""
        return f"{self._block_key_prefix}{block:016x}"

    async def _call(self, what: str, operation: Awaitable[_T]) -> _T:
        """Await one Redis operation within ``timeout_s``; any failure is ``IndexUnavailable``."""
        return await call_redis(f"redis block index {what}", self._timeout_s, operation)

    # ------------------------------------------------------------------ epochs and liveness

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Declare ``epoch`` the live incarnation of ``replica``; entries of other epochs die."""
        check_replica(replica)
        check_epoch(epoch)
        if self._primary_moved.watched(self._client):
            # A broken connection learns a crash failover on reconnecting: learned here, the
            # move is counted before the declaration and settled by it.
            await self._call("ping", self._client.ping())
        moves = self._primary_moved.count(self._client)
        await self._call(
            "set_epoch", self._set_epoch(keys=self._slot_keys, args=[replica, str(epoch)])
        )
        self._primary_moved.settle(moves)

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Retire ``epoch``: if it is the live one, the replica matches nothing until a new one."""
        check_replica(replica)
        check_epoch(epoch)
        await self._call(
            "retire_epoch", self._retire(keys=self._slot_keys, args=[replica, str(epoch)])
        )

    async def heartbeat(self, replica: ReplicaId, ttl_s: float) -> None:
        """Keep ``replica``'s entries matching for ``ttl_s`` more seconds (server clock)."""
        check_replica(replica)
        check_ttl(ttl_s, optional=False)
        await self._call(
            "heartbeat", self._heartbeat(keys=[self._alive_key], args=[replica, _to_ms(ttl_s)])
        )

    async def heartbeat_known(self, replica: ReplicaId, ttl_s: float) -> bool:
        """Heartbeat; False when Redis no longer knows the replica's epoch (``FLUSHALL``, a
        restart without persistence): the agent must declare an epoch and re-record."""
        check_replica(replica)
        check_ttl(ttl_s, optional=False)
        keys = [self._alive_key, self._epochs_key]
        known = await self._call(
            "heartbeat", self._heartbeat(keys=keys, args=[replica, _to_ms(ttl_s)])
        )
        return bool(int(known)) and not self._primary_moved.check(self._client)

    # ------------------------------------------------------------------ writes

    async def record(
        self,
        replica: ReplicaId,
        epoch: Epoch,
        blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        """Record that ``replica`` at ``epoch`` holds ``blocks`` (speculatively if ``ttl_s``).

        Same rules as ``MemoryBlockIndex.record``: writes for a non-live epoch are dropped, a new
        replica adopts ``epoch``, and a speculative write never downgrades a confirmed entry.
        """
        check_replica(replica)
        check_epoch(epoch)
        check_ttl(ttl_s)
        check_blocks(blocks)
        if not blocks:
            return
        speculative_ms = "" if ttl_s is None else _to_ms(ttl_s)
        args = [
            replica,
            str(epoch),
            speculative_ms,
            self._block_ttl_ms,
            self._block_key_prefix,
            _joined(blocks),
        ]
        await self._call("record", self._record(keys=self._slot_keys, args=args))

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        """Forget that ``replica`` at ``epoch`` holds ``blocks``; other epochs' entries stay."""
        check_replica(replica)
        check_epoch(epoch)
        check_blocks(blocks)
        if not blocks:
            return
        args = [replica, str(epoch), self._block_key_prefix, _joined(blocks)]
        await self._call("remove", self._remove(keys=self._slot_keys[:2], args=args))

    # ------------------------------------------------------------------ lookup

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Longest live prefix of ``chain`` per replica, in blocks; one round trip.

        Raises ``IndexUnavailable`` when Redis does not answer within ``timeout_s``.
        """
        if not chain:
            return {}
        args = [self._require_heartbeat, self._touch_ms, self._block_key_prefix, _joined(chain)]
        flat = await self._call("match", self._match(keys=self._match_keys, args=args))
        names = flat[0::2]
        if names and isinstance(names[0], bytes):  # a caller's client without decode_responses
            names = [name.decode() for name in names]
        return dict(zip(names, map(int, flat[1::2]), strict=True))

    # ------------------------------------------------------------------ admin

    async def stats(self) -> IndexStats:
        """Block keys under this prefix, replicas with a live epoch, and Redis memory figures.

        Counting block keys SCANs the keyspace: meant for the admin API, not for every request.
        """
        try:
            entries = 0
            async for _ in self._client.scan_iter(match=f"{self._block_key_prefix}*", count=1000):
                entries += 1
            epochs = await self._client.hgetall(self._epochs_key)
            memory: dict[str, Any] = await self._client.info("memory")
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(f"redis block index stats failed: {exc}") from exc
        live = sum(1 for value in epochs.values() if not _text(value).startswith("~"))
        return IndexStats(
            backend="redis",
            entries=entries,
            replicas=live,
            max_entries=None,
            extra={
                "key_prefix": self.key_prefix,
                "used_memory_bytes": memory.get("used_memory"),
                "maxmemory_bytes": memory.get("maxmemory"),
                "maxmemory_policy": memory.get("maxmemory_policy"),
            },
        )

    async def close(self) -> None:
        """Close the client if this index created it."""
        if self._owns_client:
            await self._client.aclose()


def _to_ms(seconds: float) -> int:
    """Seconds to whole milliseconds, at least 1 (a 0 ms PEXPIRE would delete the key)."""
    return max(1, round(seconds * 1000))


def _joined(blocks: Sequence[BlockHash]) -> str:
    """Block hashes as one argument, 16 lowercase hex digits each: the scripts build the keys.

    One argument instead of one key per block: redis-py's asyncio client packs every argument
    in pure Python, which cost more than the lookup itself for a 375-block chain. Fixed-width hex
    is packed in C here and cut with ``string.sub`` in Lua (``redis_scripts`` measures both).
    """
    return struct.pack(f">{len(blocks)}Q", *blocks).hex()


def _text(value: str | bytes) -> str:
    """Redis replies are ``str`` with ``decode_responses``, ``bytes`` from a caller's client."""
    return value.decode() if isinstance(value, bytes) else value
