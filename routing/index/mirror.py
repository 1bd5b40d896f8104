"""``MirrorBlockIndex``: each gateway's in-process copy of the shared index, fed by Redis streams.

Lookups never leave the process: ``match_now`` walks a local ``MemoryBlockIndex``. Redis holds
the shared truth in the stream layout (``stream_layout``): per replica its live epoch, sequence
number, heartbeat deadline and confirmed blocks, plus one capped event stream per shard. A mirror

1. **bootstraps**: reads each shard's last stream id, then each replica's snapshot (atomic per
   replica: epoch, sequence number, blocks), then the last ``speculative_catchup_s`` of guesses
   still in the streams;
2. **tails** every shard's stream from those ids and applies each event to the local index, in
   order. Engine-confirmed events carry the replica's sequence number and the incarnation of its
   Redis state: an event already covered by the snapshot is skipped; a *gap* (the mirror fell
   behind the stream's cap, or missed events while Redis was unreachable) or a *new
   incarnation* (Redis lost the replica's keys) reloads that replica's snapshot, and
   ``stats().extra["replica_reloads"]`` counts each by reason;
3. **notices a lost Redis** (``FLUSHALL``, any restart): the generation token it read at
   bootstrap is gone, or the server's ``run_id`` changed. It then routes load-only (lookups
   raise ``IndexUnavailable``) until it has rebuilt from what Redis holds; the agents notice a
   lost epoch too and re-publish.

Store epochs (the agents' numbers) map to *local* epochs that this mirror numbers itself, so a
snapshot reload can start a replica afresh in the local index without ever reusing an epoch
number there. Own writes go to Redis first (confirmed) or after (speculative: the decision must
show at once) and are applied locally at once; their echo from the stream is idempotent.

While its tail cannot reach Redis the mirror does not answer (lookups raise
``IndexUnavailable``: load-only, as in lookup mode), since it would miss retirements meanwhile;
the tail resumes where it stopped, and a gap or a lost generation is handled as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError

from routing.contracts import IndexStats, IndexUnavailable
from routing.index import stream_scripts
from routing.index._validate import check_blocks, check_epoch, check_replica, check_ttl
from routing.index.memory import MemoryBlockIndex
from routing.index.redis_client import IndexRedis, connect
from routing.index.stream_layout import DEFAULT_SHARDS
from routing.index.stream_writer import DEFAULT_STREAM_MAX_LEN, StreamIndexWriter, unpack_blocks
from routing.outage_log import OutageLog
from routing.types import BlockHash, Epoch, ReplicaId

__all__ = ["MirrorBlockIndex", "MirrorFollowCounters"]

log = logging.getLogger(__name__)

#: Replicas whose snapshots one pipeline reads at bootstrap.
_SNAPSHOT_BATCH = 16
#: Stream entries one tail read takes at most.
_TAIL_COUNT = 2000
#: What "Redis is unavailable" looks like; ``RedisClusterException`` (not a ``RedisError``) too:
#: a Cluster that cannot be mapped (slots unassigned, no node reachable) must not end the tail.
_REDIS_DOWN = (RedisError, RedisClusterException, OSError, TimeoutError, IndexUnavailable)
#: How often a lasting Redis outage is logged again (s).
OUTAGE_LOG_INTERVAL_S = 60.0


class _ShardReads:
    """The tail's blocking reads of the shards' streams.

    One server: one ``XREAD`` of every stream. A Redis Cluster refuses an ``XREAD`` of keys in
    different slots, and each shard is a slot: there, one ``XREAD`` per shard is kept in flight,
    on a plain connection to the primary that owns the shard's slot (the Cluster client's own
    connections are not made for several blocking reads at once), and ``next`` returns as soon
    as any of them answers: a shard with no news must not hold back the others' events for a
    whole blocking read. A slot that moves makes its read fail; the tail then starts again and
    looks the owners up afresh.
    """

    def __init__(self, client: IndexRedis, block_ms: int, options: Mapping[str, Any]) -> None:
        self._client = client
        self._block_ms = block_ms
        self._options = options
        self._cluster = isinstance(client, aioredis.RedisCluster)
        self._pending: dict[str, asyncio.Task[Any]] = {}
        #: "host:port" of a primary -> a plain client of it (Cluster only).
        self._primaries: dict[str, aioredis.Redis] = {}

    def _reader_of(self, key: str) -> aioredis.Redis:
        assert isinstance(self._client, aioredis.RedisCluster)
        node = self._client.get_node_from_key(key)
        reader = self._primaries.get(node.name)
        if reader is None:
            # The node's own connection settings (credentials, TLS), with this tail's timeouts:
            # a reader built from host and port alone cannot read a password or TLS cluster.
            pool = aioredis.ConnectionPool(
                connection_class=node.connection_class,
                **{**node.connection_kwargs, **self._options},
            )
            reader = self._primaries[node.name] = aioredis.Redis(connection_pool=pool)
        return reader

    async def next(self, last_ids: dict[str, bytes]) -> list[Any]:
        """Replies as ``XREAD`` gives them: [(stream key, [(entry id, fields), ...]), ...]."""
        if not self._cluster:
            return list(
                await self._client.xread(
                    streams=dict(last_ids), count=_TAIL_COUNT, block=self._block_ms
                )
                or ()
            )
        await self._client.initialize()  # the slot map (a no-op once it is known)
        for key, last in last_ids.items():
            if key not in self._pending:
                self._pending[key] = asyncio.ensure_future(
                    self._reader_of(key).xread(
                        streams={key: last}, count=_TAIL_COUNT, block=self._block_ms
                    )
                )
        done, _ = await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        replies: list[Any] = []
        for key, task in list(self._pending.items()):
            if task in done:
                del self._pending[key]
                replies.extend(task.result() or ())  # raises a failed read's error
        return replies

    async def close(self) -> None:
        """Stop the reads in flight and close the primaries' connections (the tail is ending:
        an error, a rebuild, closing).

        On a Cluster it also drops the slot map, so that the next tail looks the owners up
        afresh. The reads go over plain connections, whose ``MOVED`` and refused connections
        never reach the Cluster client, and ``initialize`` maps the slots only once: kept, the
        map sent every later tail to the failed or former owner, and the mirror stayed frozen
        until the gateway restarted (a failover or one moved slot was enough).
        """
        for task in self._pending.values():
            task.cancel()
        for task in self._pending.values():
            with contextlib.suppress(BaseException):
                await task
        self._pending.clear()
        for reader in self._primaries.values():
            await reader.aclose()
        self._primaries.clear()
        if self._cluster:
            await self._client.aclose()  # the next initialize() reads the slot map again


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True)
class MirrorFollowCounters:
    """How a mirror follows Redis, for metrics: read without awaiting anything."""

    ready: bool
    connected: bool
    events_applied: int
    #: Replicas reloaded from their snapshot, by reason: ``gap`` (events missed: the stream's
    #: cap, an outage) or ``store_reset`` (Redis lost the replica's keys).
    replica_reloads: Mapping[str, int]
    #: Whole rebuilds after Redis lost its data (flush, restart without persistence).
    rebuilds: int
    tail_errors: int


class MirrorBlockIndex:
    """A ``BlockIndex`` answered in process, kept in step with Redis streams (module doc).

    ``redis_url`` names the shared Redis; ``key_prefix`` and ``shards`` must match the agents'.
    Local options (``max_entries``, ``clock``, ``require_heartbeat``) are the memory index's.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        key_prefix: str = "fleetgate:",
        shards: int = DEFAULT_SHARDS,
        timeout_s: float = 0.1,
        stream_max_len: int = DEFAULT_STREAM_MAX_LEN,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
        require_heartbeat: bool = False,
        check_interval_s: float = 1.0,
        tail_block_ms: int = 500,
        bootstrap_timeout_s: float = 30.0,
        speculative_catchup_s: float = 30.0,
    ) -> None:
        if not isinstance(redis_url, str):
            raise TypeError(f"redis_url must be a URL string (got {redis_url!r})")
        check_ttl(check_interval_s, "check_interval_s", optional=False)
        check_ttl(bootstrap_timeout_s, "bootstrap_timeout_s", optional=False)
        check_ttl(speculative_catchup_s, "speculative_catchup_s", optional=False)
        if (
            isinstance(tail_block_ms, bool)
            or not isinstance(tail_block_ms, int)
            or (tail_block_ms <= 0)
        ):
            raise ValueError(f"tail_block_ms must be a positive integer (got {tail_block_ms!r})")
        self._origin = uuid.uuid4().hex[:16]
        self._writer = StreamIndexWriter(
            redis_url,
            key_prefix=key_prefix,
            shards=shards,
            timeout_s=timeout_s,
            stream_max_len=stream_max_len,
            origin=self._origin,
        )
        self.layout = self._writer.layout
        # The tail blocks in XREAD for up to tail_block_ms: its own client, with a socket
        # timeout above that (the writer's would cut every blocking read short).
        self._tail_options = {
            "socket_timeout": tail_block_ms / 1000 + max(timeout_s, 1.0),
            "socket_connect_timeout": max(timeout_s, 1.0),
        }
        self._tail_client = connect(redis_url, **self._tail_options)
        # Snapshots are bulk reads: a pipeline of them returns nothing until Redis has run every
        # script, which for a fleet holding millions of blocks takes far longer than a lookup's
        # timeout (with it, the bootstrap would time out and retry forever, routing load-only).
        # Their own client waits as long as the bootstrap may take.
        self._bulk_client = connect(
            redis_url,
            socket_timeout=bootstrap_timeout_s,
            socket_connect_timeout=max(timeout_s, 1.0),
        )
        self._snapshot = self._bulk_client.register_script(stream_scripts.SNAPSHOT)
        self._local_options: dict[str, Any] = {
            "max_entries": max_entries,
            "clock": clock,
            "require_heartbeat": require_heartbeat,
        }
        self._local = MemoryBlockIndex(**self._local_options)
        self._check_interval_s = float(check_interval_s)
        self._tail_block_ms = tail_block_ms
        self._bootstrap_timeout_s = float(bootstrap_timeout_s)
        self._catchup_ms = round(speculative_catchup_s * 1000)
        self._local_epochs = itertools.count(1)
        #: Per replica: its store epoch (``None``: retired) and the local epoch standing for it.
        self._store_epoch: dict[ReplicaId, Epoch | None] = {}
        self._local_epoch: dict[ReplicaId, Epoch] = {}
        #: Per replica: (incarnation of its Redis state, last sequence number applied).
        self._seq: dict[ReplicaId, tuple[bytes, int]] = {}
        self._last_ids: dict[str, bytes] = {}
        self._generation: bytes | None = None
        self._ready = asyncio.Event()
        self._progress = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._events_applied = 0
        self._reloads: Counter[str] = Counter()
        self._rebuilds = 0
        self._tail_errors = 0
        #: The Redis Cluster's ``cluster_current_epoch`` when its topology was last read.
        self._cluster_epoch: object = None
        #: Whether the current tail has applied a read (``_follow`` then retries at once).
        self._tail_progressed = False
        #: False while the tail cannot reach Redis: lookups then degrade to load-only.
        self._connected = True
        #: While Redis is unreachable (a wrong password retried every second logged a warning
        #: every second, for good).
        self._outage = OutageLog(OUTAGE_LOG_INTERVAL_S)
        #: The Redis server's clock less this process's (ms), read at bootstrap.
        self._server_offset_ms = 0.0

    # ------------------------------------------------------------------ lifecycle

    def _ensure_started(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(
                self._follow(), name="fleetgate-index-mirror"
            )

    async def start(self) -> None:
        """Start following Redis and wait (up to ``bootstrap_timeout_s``) for the bootstrap."""
        self._ensure_started()
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        if self._ready.is_set():
            return
        self._ensure_started()
        try:
            async with asyncio.timeout(self._bootstrap_timeout_s):
                await self._ready.wait()
        except TimeoutError as exc:
            raise IndexUnavailable(
                f"index mirror not bootstrapped within {self._bootstrap_timeout_s}s"
            ) from exc

    @property
    def ready(self) -> bool:
        """True once bootstrapped (and not rebuilding after Redis lost its data)."""
        return self._ready.is_set()

    async def close(self) -> None:
        """Stop following and close both Redis clients."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._tail_client.aclose()
        await self._bulk_client.aclose()
        await self._writer.close()

    # ------------------------------------------------------------------ following Redis

    async def _follow(self) -> None:
        """Bootstrap, then tail; on errors retry (the local index keeps answering)."""
        backoff = 0.05
        traceback_logged_at = -math.inf
        # ``_closed`` too, not only cancellation: redis-py may turn a cancel that lands inside a
        # blocking read into a connection error, which the retry below would otherwise absorb.
        while not self._closed:
            self._tail_progressed = False
            try:
                if not self._ready.is_set():
                    await self._bootstrap()
                    self._ready.set()
                    self._progress.set()
                await self._tail()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._tail_errors += 1
                self._connected = False
                if self._tail_progressed:
                    # It had recovered: this is a new fault, not the old one lasting; the next
                    # attempt comes soon (each later one would wait a second of load-only routing).
                    backoff = 0.05
                if isinstance(exc, MovedError | AskError):
                    # Not an outage: a slot changed owner (a failover, a resharding).
                    log.warning(
                        "index mirror: a Redis Cluster slot moved (%s: %s); reading the slot "
                        "map again",
                        type(exc).__name__,
                        exc,
                    )
                elif isinstance(exc, _REDIS_DOWN):
                    if self._outage.failed(time.monotonic()):
                        log.warning(
                            "index mirror: Redis unavailable (%s: %s); retrying every second "
                            "(%d failed attempt(s) so far; said again at most once a minute)",
                            type(exc).__name__,
                            exc,
                            self._outage.failures,
                        )
                else:
                    # Anything else (a redis-py Cluster client racing its own reconnects raised
                    # AttributeError in a live failover) ended the task for good before: the
                    # gateway routed on load alone, silently, until restarted. Retry; the
                    # traceback at most once a minute.
                    now = time.monotonic()
                    log.error(
                        "index mirror: unexpected %s: %s; retrying",
                        type(exc).__name__,
                        exc,
                        exc_info=now - traceback_logged_at >= 60.0,
                    )
                    if now - traceback_logged_at >= 60.0:
                        traceback_logged_at = now
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            else:
                backoff = 0.05

    def _mark_connected(self) -> None:
        """The tail reaches Redis (again): say so once after an outage that was logged."""
        self._connected = True
        if (ended := self._outage.recovered()) is not None:
            log.warning("index mirror: Redis reachable again after %d failed attempt(s)", ended)

    async def _read_generation(self) -> bytes:
        """The data's generation: the token, and the server's ``run_id``.

        The token goes with a flush or an empty restart; the ``run_id`` changes with any
        restart, also one that reloaded a snapshot older than the last writes (sequence numbers
        would then repeat, and the mirror would skip the repeats as already applied).
        """
        client = self._writer.client
        token = await client.get(self.layout.generation_key)
        if token is None:
            await client.set(self.layout.generation_key, uuid.uuid4().hex, nx=True)
            token = await client.get(self.layout.generation_key)
        if isinstance(client, aioredis.RedisCluster):
            # The client learns a failover's new primary only when a command of its own is
            # redirected: an idle gateway kept reading the former primary's run_id and missed
            # the new one's restart (live re-check). The Cluster's epoch moves with every
            # failover: read the topology again then (rarely: it recycles the connections).
            epoch = (await client.cluster_info()).get("cluster_current_epoch")
            if epoch != self._cluster_epoch:
                if self._cluster_epoch is not None:
                    await client.nodes_manager.initialize()
                self._cluster_epoch = epoch
            # Any primary's restart may have lost the shards it holds.
            infos = await client.info("server", target_nodes=aioredis.RedisCluster.PRIMARIES)
            run_id = ",".join(sorted(str(info.get("run_id", "")) for info in infos.values()))
        else:
            run_id = (await client.info("server")).get("run_id", "")
        return bytes(token) + b"/" + str(run_id).encode()

    async def _bootstrap(self) -> None:
        """Read every replica's snapshot and the recent guesses; set the tail's start ids."""
        client = self._writer.client
        generation = await self._read_generation()
        keys = self.layout.all_events_keys()
        # A context: a pipeline whose execute fails (Redis going down) is still released,
        # instead of being reported later as an unclosed client at ERROR.
        async with client.pipeline(transaction=False) as pipe:
            for shard, key in enumerate(keys):
                pipe.xrevrange(key, count=1)
                pipe.smembers(self.layout.replicas_key(shard))
            replies = await pipe.execute()
        seconds, micros = await client.time()  # not pipelined: a Cluster pipeline refuses it
        server_ms = seconds * 1000 + micros // 1000
        # Stream ids are the server's ms: the tail ages guesses by them, on this offset.
        self._server_offset_ms = server_ms - time.time() * 1000.0
        last_ids: dict[str, bytes] = {}
        replicas: list[ReplicaId] = []
        for shard, key in enumerate(keys):
            newest, members = replies[2 * shard], replies[2 * shard + 1]
            last_ids[key] = newest[0][0] if newest else b"0-0"
            replicas.extend(sorted(member.decode() for member in members))
        # Start afresh: this is the first bootstrap, or a rebuild after Redis lost its data.
        self._local = MemoryBlockIndex(**self._local_options)
        self._store_epoch.clear()
        self._local_epoch.clear()
        self._seq.clear()
        for start in range(0, len(replicas), _SNAPSHOT_BATCH):
            batch = replicas[start : start + _SNAPSHOT_BATCH]
            for replica, reply in zip(batch, await self._snapshots(batch), strict=True):
                self._apply_snapshot(replica, reply)
        # Guesses are not in the snapshots: take the ones young enough to still matter.
        since = f"{max(0, server_ms - self._catchup_ms)}-0"
        for key in keys:
            if last_ids[key] == b"0-0":
                continue
            guesses = await self._bulk_client.xrange(key, min=since, max=last_ids[key])
            for entry_id, fields in guesses:
                if fields.get(b"o") == b"s":
                    age_ms = server_ms - _stream_id(entry_id)[0]
                    self._apply_guess(fields, age_ms)
        self._last_ids = last_ids
        self._generation = generation
        # It has just read all of it from Redis: answer from it now. Left False (a lost tail),
        # lookups would degrade between the rebuild and the tail's first reply, and a caller
        # that saw the mirror ready would get IndexUnavailable.
        self._mark_connected()
        log.info("index mirror: bootstrapped %d replicas", len(replicas))

    async def _snapshots(self, replicas: Sequence[ReplicaId]) -> list[Any]:
        """The ``SNAPSHOT`` script's reply for each of ``replicas``: pipelined on one server,
        sent concurrently on a Cluster (whose pipelines refuse scripts)."""
        client = self._bulk_client
        keys = [self.layout.replica_keys(replica) for replica in replicas]
        if isinstance(client, aioredis.RedisCluster):
            # Learn the slots first: concurrent first commands on a fresh Cluster client race
            # in its set-up (a connection used before it is open).
            await client.initialize()
            return list(
                await asyncio.gather(
                    *(self._snapshot(keys=[k.state, k.blocks], client=client) for k in keys)
                )
            )
        async with client.pipeline(transaction=False) as pipe:
            for k in keys:
                await self._snapshot(keys=[k.state, k.blocks], client=pipe)
            return list(await pipe.execute())

    async def _tail(self) -> None:
        """Apply stream events until an error or a lost generation (then rebuild)."""
        # (Re)connected: is it still the data this mirror holds? Checked before anything is
        # answered from it, so that lookups after a restart never use the old data while the
        # first periodic check is still to come (they would, then degrade during the rebuild).
        if await self._read_generation() != self._generation:
            self._lost_store()
            return
        self._mark_connected()
        next_check = time.monotonic() + self._check_interval_s
        reads = _ShardReads(self._tail_client, self._tail_block_ms, self._tail_options)
        try:
            await self._tail_streams(reads, next_check)
        finally:
            await reads.close()

    async def _tail_streams(self, reads: _ShardReads, next_check: float) -> None:
        while not self._closed:
            replies = await reads.next(self._last_ids)
            self._mark_connected()
            for raw_key, entries in replies or ():
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                for entry_id, fields in entries:
                    await self._apply_entry(key, entry_id, fields)
                    self._last_ids[key] = entry_id
            self._tail_progressed = True
            self._progress.set()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self._check_interval_s
                if await self._read_generation() != self._generation:
                    self._lost_store()
                    return

    def _lost_store(self) -> None:
        """Redis lost its data: route load-only until rebuilt (``_follow`` bootstraps again)."""
        self._rebuilds += 1
        self._ready.clear()
        log.warning(
            "index mirror: Redis may have lost the index (a flush, a restart, or a failover to "
            "a replica: Cluster or Sentinel); rebuilding"
        )

    async def sync(self, timeout_s: float = 5.0) -> None:
        """Wait until this mirror has applied every event in the streams now (tests, tools).

        Raises ``TimeoutError`` naming what it waited for if that takes over ``timeout_s``.
        """
        await self._wait_ready()
        pipe = self._writer.client.pipeline(transaction=False)
        keys = self.layout.all_events_keys()
        for key in keys:
            pipe.xrevrange(key, count=1)
        targets = {
            key: _stream_id(reply[0][0])
            for key, reply in zip(keys, await pipe.execute(), strict=True)
            if reply
        }
        try:
            async with asyncio.timeout(timeout_s):
                while any(
                    _stream_id(self._last_ids.get(key, b"0-0")) < target
                    for key, target in targets.items()
                ):
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError as exc:
            raise TimeoutError(
                f"index mirror did not reach the streams' ends within {timeout_s}s"
            ) from exc

    # ------------------------------------------------------------------ applying events

    async def _apply_entry(self, key: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """``_apply_event``, skipping an entry it cannot read: raised, the tail read it again
        and again (its position moves past an entry only once applied), every later event of
        the shard waited behind it, and the mirror routed on load alone. The replica it names
        is reloaded from its snapshot, which its events since then continue."""
        try:
            await self._apply_event(fields, entry_id)
        except _REDIS_DOWN:
            raise
        except Exception as exc:
            log.error(
                "index mirror: skipped entry %s of %s that it cannot read (%s: %s); fields %s",
                entry_id.decode(errors="replace"),
                key,
                type(exc).__name__,
                exc,
                sorted(k.decode(errors="replace") for k in fields),
            )
            replica = fields.get(b"p")
            if replica:
                await self._reload(ReplicaId(replica.decode(errors="replace")), "bad_entry")

    async def _apply_event(self, fields: dict[bytes, bytes], entry_id: bytes) -> None:
        op = fields[b"o"]
        if op == b"s":
            if fields.get(b"g", b"").decode() != self._origin:  # our own guess is applied
                # Aged by when it was written: after an outage or a lag, a guess read late
                # lives only what is left of its time, and an expired one not at all.
                server_now_ms = time.time() * 1000.0 + self._server_offset_ms
                self._apply_guess(fields, max(0.0, server_now_ms - _stream_id(entry_id)[0]))
            return
        replica = ReplicaId(fields[b"p"].decode())
        seq, incarnation = int(fields[b"q"]), fields[b"i"]
        known = self._seq.get(replica)
        if known is not None and known[0] == incarnation:
            if seq <= known[1]:
                return  # the snapshot (or an earlier reload) covered it
            if seq != known[1] + 1:
                await self._reload(replica, "gap")
                return
        elif seq != 1:
            await self._reload(replica, "gap" if known is None else "store_reset")
            return
        elif known is not None:
            # A new incarnation of the replica's Redis state: Redis lost it. Start it afresh.
            self._reloads["store_reset"] += 1
            self._forget(replica)
        self._seq[replica] = (incarnation, seq)
        self._events_applied += 1
        epoch_text = fields.get(b"e", b"")
        epoch = Epoch(int(epoch_text)) if epoch_text else None
        if op == b"e" and epoch is not None:
            self._apply_set_epoch(replica, epoch)
        elif op == b"t" and epoch is not None:
            self._apply_retire(replica, epoch)
        elif op == b"r" and epoch is not None:
            self._apply_record(replica, epoch, unpack_blocks(fields[b"b"]), None)
        elif op == b"x" and epoch is not None:
            self._apply_remove(replica, epoch, unpack_blocks(fields[b"b"]))
        elif op == b"h":
            self._local.heartbeat_now(replica, int(fields[b"t"]) / 1000)

    def _apply_guess(self, fields: dict[bytes, bytes], age_ms: float) -> None:
        ttl_ms = int(fields[b"t"]) - age_ms
        if ttl_ms <= 0:
            return
        self._apply_record(
            ReplicaId(fields[b"p"].decode()),
            Epoch(int(fields[b"e"])),
            unpack_blocks(fields[b"b"]),
            ttl_ms / 1000,
        )

    async def _reload(self, replica: ReplicaId, reason: str) -> None:
        keys = self.layout.replica_keys(replica)
        reply = await self._snapshot(keys=[keys.state, keys.blocks])
        self._reloads[reason] += 1
        log.info("index mirror: reloaded replica %s (%s)", replica, reason)
        self._apply_snapshot(replica, reply)

    def _apply_snapshot(self, replica: ReplicaId, reply: Sequence[bytes]) -> None:
        epoch_text = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        self._seq[replica] = (bytes(reply[2]), int(reply[1]))
        if epoch_text and not epoch_text.startswith("~"):
            self._declare(replica, Epoch(int(epoch_text)))
            blocks = unpack_blocks(b"".join(reply[4:]))
            if blocks:
                self._local.record_now(replica, self._local_epoch[replica], blocks)
        else:
            self._forget(replica)
            if epoch_text:  # retired: writes for it are dropped, as in Redis
                self._store_epoch[replica] = None
        left_ms = int(reply[3])
        if left_ms >= 0:
            self._local.heartbeat_now(replica, max(left_ms, 1) / 1000)

    def _declare(self, replica: ReplicaId, epoch: Epoch) -> None:
        """A fresh local incarnation for ``replica`` at store epoch ``epoch`` (empty)."""
        local = Epoch(next(self._local_epochs))
        self._local.set_epoch_now(replica, local)
        self._store_epoch[replica] = epoch
        self._local_epoch[replica] = local

    def _forget(self, replica: ReplicaId) -> None:
        """The replica matches nothing locally; its next write adopts an epoch again."""
        local = self._local_epoch.pop(replica, None)
        if local is not None:
            self._local.retire_epoch_now(replica, local)
        self._store_epoch.pop(replica, None)

    def _apply_set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        if self._store_epoch.get(replica) != epoch or replica not in self._local_epoch:
            self._declare(replica, epoch)

    def _apply_retire(self, replica: ReplicaId, epoch: Epoch) -> None:
        if self._store_epoch.get(replica) == epoch:
            self._local.retire_epoch_now(replica, self._local_epoch[replica])
            self._store_epoch[replica] = None

    def _apply_record(
        self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash], ttl_s: float | None
    ) -> None:
        if replica not in self._store_epoch:
            self._declare(replica, epoch)  # a replica seen for the first time adopts the epoch
        if self._store_epoch[replica] == epoch:
            self._local.record_now(replica, self._local_epoch[replica], blocks, ttl_s)

    def _apply_remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        if self._store_epoch.get(replica) == epoch:
            self._local.remove_now(replica, self._local_epoch[replica], blocks)

    # ------------------------------------------------------------------ the BlockIndex protocol

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Declare ``epoch`` live, in Redis (every mirror) and here."""
        check_replica(replica)
        check_epoch(epoch)
        await self._wait_ready()
        await self._writer.set_epoch(replica, epoch)
        await self._read_own_write(lambda: self._apply_set_epoch(replica, epoch))

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Retire ``epoch`` if it is the live one, in Redis and here."""
        check_replica(replica)
        check_epoch(epoch)
        await self._wait_ready()
        await self._writer.retire_epoch(replica, epoch)
        await self._read_own_write(lambda: self._apply_retire(replica, epoch))

    async def record(
        self,
        replica: ReplicaId,
        epoch: Epoch,
        blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        """Record blocks: a guess shows here at once, then goes to the stream; a confirmed write
        goes to Redis first (the truth must hold whatever a mirror holds)."""
        check_replica(replica)
        check_epoch(epoch)
        check_ttl(ttl_s)
        check_blocks(blocks)
        if not blocks:
            return
        await self._wait_ready()
        if ttl_s is not None:
            self._apply_record(replica, epoch, blocks, ttl_s)
            await self._writer.record(replica, epoch, blocks, ttl_s)
            return
        await self._writer.record(replica, epoch, blocks)
        await self._read_own_write(lambda: self._apply_record(replica, epoch, blocks, None))

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        """Forget confirmed blocks of the live ``epoch``, in Redis and here."""
        check_replica(replica)
        check_epoch(epoch)
        check_blocks(blocks)
        if not blocks:
            return
        await self._wait_ready()
        await self._writer.remove(replica, epoch, blocks)
        await self._read_own_write(lambda: self._apply_remove(replica, epoch, blocks))

    async def _read_own_write(self, apply_locally: Callable[[], None]) -> None:
        """Make a confirmed write just sent to Redis visible here before returning.

        Through the tail, in stream order: applying it locally at once and again when the tail
        reaches its event re-ordered writes (a record, then its removal, both applied here, then
        the record re-applied by the tail showed the removed block again until the removal
        came round). Gateways write guesses only (applied at once, the tail skips its own); this
        path serves tools and tests that write confirmed blocks through a mirror. If the tail
        cannot catch up in time, the write is applied locally after all (the tail converges).
        """
        try:
            await self.sync(timeout_s=self._bootstrap_timeout_s)
        except _REDIS_DOWN:
            apply_locally()

    async def heartbeat(self, replica: ReplicaId, ttl_s: float) -> None:
        """Keep ``replica``'s entries matching for ``ttl_s`` more seconds (every mirror)."""
        await self.heartbeat_known(replica, ttl_s)

    async def heartbeat_known(self, replica: ReplicaId, ttl_s: float) -> bool:
        """Heartbeat; False when Redis no longer knows the replica's epoch (see the writer)."""
        check_replica(replica)
        check_ttl(ttl_s, optional=False)
        await self._wait_ready()
        known = await self._writer.heartbeat_known(replica, ttl_s)
        self._local.heartbeat_now(replica, ttl_s)
        return known

    def match_now(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Longest live prefix per replica, from the local mirror: no network, no waiting.

        Raises ``IndexUnavailable`` until bootstrapped, and while rebuilding after Redis lost
        its data (routing is then load-only).
        """
        if not self._ready.is_set():
            self._ensure_started()
            raise IndexUnavailable("index mirror is not bootstrapped (starting or rebuilding)")
        if not self._connected:
            raise IndexUnavailable("index mirror cannot reach Redis (it would miss retirements)")
        return self._local.match_now(chain)

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """``match_now``, once bootstrapped."""
        await self._wait_ready()
        return self.match_now(chain)

    def follow_counters(self) -> MirrorFollowCounters:
        """How this mirror follows Redis (``gateway/index_metrics`` exports them)."""
        return MirrorFollowCounters(
            ready=self.ready,
            connected=self._connected,
            events_applied=self._events_applied,
            replica_reloads=dict(self._reloads),
            rebuilds=self._rebuilds,
            tail_errors=self._tail_errors,
        )

    async def stats(self) -> IndexStats:
        """The local mirror's figures, plus how it follows Redis."""
        local = await self._local.stats()
        return IndexStats(
            backend="mirror",
            entries=local.entries,
            replicas=local.replicas,
            max_entries=local.max_entries,
            extra={
                **local.extra,
                "key_prefix": self.layout.key_prefix,
                "shards": self.layout.shards,
                "ready": self.ready,
                "connected": self._connected,
                "events_applied": self._events_applied,
                "replica_reloads": dict(self._reloads),
                "rebuilds": self._rebuilds,
                "tail_errors": self._tail_errors,
            },
        )
