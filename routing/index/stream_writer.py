"""The write side of the mirrored index: engine events and guesses into Redis streams.

Agents write through it (``index.mode: mirror``); gateways' ``MirrorBlockIndex`` writes through
it too. Confirmed writes run the ``WRITE`` script (the replica's keys and the stream change
together); a speculative write is one plain ``XADD`` (guesses are not part of the snapshot: they
live seconds, and a gateway that starts late reads the stream's last ``speculative_ttl`` of them).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from routing.contracts import IndexLost, IndexStats, IndexUnavailable
from routing.index import stream_scripts
from routing.index._redis_call import call_redis
from routing.index._validate import check_blocks, check_epoch, check_replica, check_ttl
from routing.index.redis_client import IndexRedis, connect
from routing.index.stream_layout import DEFAULT_SHARDS, StreamLayout
from routing.redis_clients import bounded_options
from routing.redis_sentinel import PrimaryMoves
from routing.types import BlockHash, Epoch, ReplicaId

__all__ = ["DEFAULT_STREAM_MAX_LEN", "StreamIndexWriter", "pack_blocks", "unpack_blocks"]

_T = TypeVar("_T")

#: Events kept per shard stream (``XADD MAXLEN ~``). A gateway further behind than this reloads
#: the replicas whose events it lost (it notices by their sequence numbers). Streams cost
#: memory: up to shards x this x event size (a 375-block guess is ~3.1 KB), so 10,000 per
#: shard, about 30 s of history at 5,000 routed requests/s over 16 shards (docs/index.md).
DEFAULT_STREAM_MAX_LEN = 10_000


def pack_blocks(blocks: Sequence[BlockHash]) -> bytes:
    """Block hashes as one binary string, 8 bytes big-endian each (packed in C)."""
    return struct.pack(f">{len(blocks)}Q", *blocks)


def unpack_blocks(payload: bytes) -> tuple[BlockHash, ...]:
    """The inverse of ``pack_blocks``."""
    return struct.unpack(f">{len(payload) // 8}Q", payload)  # type: ignore[return-value]


def _lost(replica: ReplicaId) -> IndexLost:
    # The write script answers 0 when the replica had no epoch: Redis lost it since the writer
    # declared one (a write adopts the epoch, so the next heartbeat would not notice).
    return IndexLost(
        f"Redis no longer knows replica {replica}'s epoch (flushed, or restarted without "
        "persistence): re-declare it and re-record the engine's blocks"
    )


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


class StreamIndexWriter:
    """Writes one fleet's block events to the stream layout (see ``stream_layout``).

    ``redis`` is a URL (owned, closed by ``close``) or a ``redis.asyncio.Redis`` created with
    ``decode_responses=False`` (values are binary). ``timeout_s`` bounds every call; a failure
    raises ``IndexUnavailable``.
    """

    def __init__(
        self,
        redis: str | IndexRedis,
        *,
        key_prefix: str = "fleetgate:",
        shards: int = DEFAULT_SHARDS,
        timeout_s: float = 0.1,
        stream_max_len: int = DEFAULT_STREAM_MAX_LEN,
        origin: str = "",
    ) -> None:
        check_ttl(timeout_s, "timeout_s", optional=False)
        if isinstance(stream_max_len, bool) or not isinstance(stream_max_len, int) or (
            stream_max_len < 100
        ):
            raise ValueError(f"stream_max_len must be an integer >= 100 (got {stream_max_len!r})")
        self.layout = StreamLayout(key_prefix, shards)
        self._timeout_s = float(timeout_s)
        self._max_len = str(stream_max_len)
        #: Tags this writer's speculative events, so the gateway that wrote them skips the echo.
        self.origin = origin
        if isinstance(redis, str):
            self._client = connect(redis, **bounded_options(timeout_s))
            self._owns_client = True
        else:
            self._client = redis
            self._owns_client = False
        self._write = self._client.register_script(stream_scripts.WRITE)
        self._primary_moved = PrimaryMoves()
        #: Replicas whose epoch Redis knew at this writer's last confirmed write (or that it
        #: declared): a later write that finds none means Redis lost it (``IndexLost``).
        self._declared: set[ReplicaId] = set()

    def _check_known(self, replica: ReplicaId, known: int) -> None:
        """After a confirmed write: raise ``IndexLost`` if Redis had forgotten an epoch this
        writer saw live. A replica new to this writer adopts the epoch (first write)."""
        if known:
            self._declared.add(replica)
        elif replica in self._declared:
            raise _lost(replica)
        else:
            self._declared.add(replica)

    @property
    def client(self) -> IndexRedis:
        """The Redis client (binary replies)."""
        return self._client

    async def _call(self, what: str, operation: Awaitable[_T]) -> _T:
        """Await one Redis operation within ``timeout_s``; any failure is ``IndexUnavailable``."""
        return await call_redis(f"redis index stream {what}", self._timeout_s, operation)

    async def _run(
        self, op: str, replica: ReplicaId, epoch: Epoch | None, payload: bytes = b"",
        ttl: str = "",
    ) -> int:
        keys = self.layout.replica_keys(replica).as_list()
        args = [op, replica, "" if epoch is None else str(epoch), self._max_len, payload, ttl]
        return int(await self._call(op, self._write(keys=keys, args=args)))

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Declare ``epoch`` live: the replica's confirmed blocks are emptied."""
        check_replica(replica)
        check_epoch(epoch)
        if self._primary_moved.watched(self._client):
            # A broken connection learns a crash failover on reconnecting: learned here, the
            # move is counted before the declaration and settled by it.
            await self._call("ping", self._client.ping())
        moves = self._primary_moved.count(self._client)
        await self._run("e", replica, epoch)
        self._primary_moved.settle(moves)
        self._declared.add(replica)

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Retire ``epoch`` if it is the live one."""
        check_replica(replica)
        check_epoch(epoch)
        await self._run("t", replica, epoch)

    async def record(
        self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        """Record confirmed blocks (script), or append a speculative guess (one ``XADD``)."""
        check_replica(replica)
        check_epoch(epoch)
        check_ttl(ttl_s)
        check_blocks(blocks)
        if not blocks:
            return
        if ttl_s is None:
            self._check_known(replica, await self._run("r", replica, epoch, pack_blocks(blocks)))
            return
        fields = {
            "o": "s", "p": replica, "e": str(epoch), "b": pack_blocks(blocks),
            "t": _ms(ttl_s), "g": self.origin,
        }
        stream = self.layout.events_key(self.layout.shard_of(replica))
        await self._call(
            "speculative record",
            self._client.xadd(stream, fields, maxlen=int(self._max_len), approximate=True),  # type: ignore[arg-type]
        )

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        """Forget confirmed blocks of the live ``epoch``."""
        check_replica(replica)
        check_epoch(epoch)
        check_blocks(blocks)
        if blocks:
            self._check_known(replica, await self._run("x", replica, epoch, pack_blocks(blocks)))

    async def heartbeat_known(self, replica: ReplicaId, ttl_s: float) -> bool:
        """Heartbeat; False when Redis no longer knows the replica's epoch (flushed, restarted
        without persistence): the caller must declare an epoch and re-record its blocks."""
        check_replica(replica)
        check_ttl(ttl_s, optional=False)
        known = bool(await self._run("h", replica, None, ttl=_ms(ttl_s)))
        return known and not self._primary_moved.check(self._client)

    async def heartbeat(self, replica: ReplicaId, ttl_s: float) -> None:
        """Keep the replica's entries matching for ``ttl_s`` more seconds."""
        await self.heartbeat_known(replica, ttl_s)

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """A writer does not look up: gateways' ``MirrorBlockIndex`` does."""
        raise IndexUnavailable("a stream index writer does not answer lookups (use a mirror)")

    async def stats(self) -> IndexStats:
        """What this writer knows without scanning: its layout."""
        return IndexStats(
            backend="mirror-writer", entries=0, replicas=0,
            extra={"key_prefix": self.layout.key_prefix, "shards": self.layout.shards},
        )

    async def close(self) -> None:
        """Close the client if this writer created it."""
        if self._owns_client:
            await self._client.aclose()
