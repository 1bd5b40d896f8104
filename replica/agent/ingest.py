"""Apply vLLM KV-event batches to fleetgate's block index, under the replica's current epoch.

This is the agent's core and has no sockets of its own: it takes decoded ``EventBatch`` es and
turns them into ``BlockIndex`` writes keyed by fleetgate's chained hash of the tokens (never
vLLM's hash), so that a gateway hashing the same prompt finds the replica.

Redis outages: a failed write marks the applier *dirty*; from then on writes are skipped (each
would wait for a timeout) while the engine-hash map keeps tracking what the engine holds.
``resync`` later declares a fresh epoch and re-records every live block, so entries written before
the outage whose ``BlockRemoved`` was missed cannot survive it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import RedisClusterException, RedisError

from replica.agent.hash_map import EngineHashMap
from replica.agent.metrics import AgentMetrics
from replica.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from routing.contracts import BlockIndex, IndexLost, IndexUnavailable
from routing.hashing import chain_seed, extend_chain
from routing.types import BlockHash, Epoch, ReplicaId

logger = logging.getLogger(__name__)

#: Failures that mean "the index backend is unreachable", as opposed to a bug in our arguments.
INDEX_DOWN_ERRORS = (IndexUnavailable, RedisError, RedisClusterException, OSError, TimeoutError)

#: Mediums whose blocks a request can hit directly; offloaded copies are not tracked.
_TRACKED_MEDIUMS = (None, "GPU")

#: How many block hashes one resync write carries.
_RESYNC_CHUNK = 512


class EpochClock:
    """Epoch numbers from the wall clock in ms, strictly increasing within a process.

    Time-based numbers need no coordination, so a replica can start a new epoch while Redis is
    down; a restarted agent on the same replica id still gets a larger number than before.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._last = 0

    def __call__(self) -> Epoch:
        self._last = max(int(self._clock() * 1000), self._last + 1)
        return Epoch(self._last)


def cache_salt_of(event: BlockStored) -> str | None:
    """The ``cache_salt`` carried by a root ``BlockStored`` event, if any.

    vLLM 0.32 publishes one ``extra_keys`` entry per block, untagged, in the order
    ``(lora_name?, (mm_id, offset)..., cache_salt?, prompt_embeds_digest?)``; the salt is only in
    the first block of a request. Strip the leading adapter name; the salt is the remaining str
    (multimodal keys are pairs, embedding digests are bytes).
    """
    if not event.extra_keys or not event.extra_keys[0]:
        return None
    keys = list(event.extra_keys[0])
    if event.lora_name is not None and keys and keys[0] == event.lora_name:
        keys = keys[1:]
    for key in keys:
        if isinstance(key, str):
            return key
    return None


class EventApplier:
    """Turns one replica's KV events into index writes and owns its epoch.

    ``model`` is the served model name the gateway hashes requests under (the chain seed); it
    may be set after construction, but before the first ``BlockStored`` is applied.
    """

    def __init__(
        self,
        index: BlockIndex,
        replica: ReplicaId,
        metrics: AgentMetrics,
        *,
        model: str | None = None,
        map_capacity: int = 262_144,
        epoch_source: Callable[[], Epoch] | None = None,
    ) -> None:
        self.index = index
        self.replica = replica
        self.metrics = metrics
        self.model = model
        self.hashes = EngineHashMap(map_capacity)
        self._next_epoch = epoch_source or EpochClock()
        self.epoch: Epoch | None = None
        #: True after a failed index write, until ``resync`` succeeds.
        self.dirty = False
        #: Events skipped because they cannot be keyed (unknown parent, bad shape, no adapter
        #: name, token ids outside [0, 2**32)).
        self.skipped_events = 0
        #: Serialises event application against resync and epoch changes.
        self.lock = asyncio.Lock()
        self._epoch_listeners: list[Callable[[Epoch], Awaitable[None]]] = []

    def on_epoch_change(self, listener: Callable[[Epoch], Awaitable[None]]) -> None:
        """Call ``listener(new_epoch)`` after every epoch change (the agent re-registers)."""
        self._epoch_listeners.append(listener)

    # ------------------------------------------------------------------ index writes

    async def _write(self, what: str, operation: Callable[[], Awaitable[None]]) -> bool:
        """Run one index write unless dirty; on failure become dirty. Returns success."""
        if self.dirty:
            return False
        try:
            await operation()
        except IndexLost as exc:
            # The write landed, but Redis had forgotten the epoch: resync re-records the rest.
            self.dirty = True
            self.metrics.index_lost()
            logger.warning("replica %s: %s; re-publishing", self.replica, exc)
            return False
        except INDEX_DOWN_ERRORS as exc:
            self.dirty = True
            self.metrics.redis_error()
            logger.warning(
                "replica %s: index %s failed (%s); buffering in memory until it returns",
                self.replica, what, exc,
            )
            return False
        return True

    async def _announce(self, epoch: Epoch) -> None:
        for listener in self._epoch_listeners:
            await listener(epoch)

    # ------------------------------------------------------------------ epochs

    async def start(self) -> Epoch:
        """Begin the first epoch of this agent (no retirement counted)."""
        async with self.lock:
            epoch = self._next_epoch()
            self.epoch = epoch
            await self._write("set_epoch", lambda: self.index.set_epoch(self.replica, epoch))
        await self._announce(epoch)
        return epoch

    async def new_epoch(self, reason: str, *, forget_hashes: bool = False) -> Epoch:
        """Retire the current epoch (``reason`` labels the metric) and declare a new one.

        ``forget_hashes`` drops the engine-hash map too: right for a new engine process, whose
        hashes need not mean what the old process's did.
        """
        async with self.lock:
            return await self._new_epoch_locked(reason, forget_hashes=forget_hashes)

    async def _new_epoch_locked(self, reason: str, *, forget_hashes: bool) -> Epoch:
        old, new = self.epoch, self._next_epoch()
        self.epoch = new
        if forget_hashes:
            self.hashes.clear()
        else:
            self.hashes.mark_all_evicted()
        if old is not None:
            self.metrics.epoch_retired(reason)
            await self._write("retire_epoch", lambda: self.index.retire_epoch(self.replica, old))
        await self._write("set_epoch", lambda: self.index.set_epoch(self.replica, new))
        logger.info("replica %s: epoch %s -> %s (%s)", self.replica, old, new, reason)
        await self._announce(new)
        return new

    async def resync(self) -> bool:
        """After an outage: new epoch, re-record every live block. True when the index is clean."""
        async with self.lock:
            if not self.dirty:
                return True
            new = self._next_epoch()
            live = list(self.hashes.live_blocks())
            try:
                # set_epoch first: it kills the old epoch's entries (including any whose
                # BlockRemoved we missed), then the live set is written under the new one.
                await self.index.set_epoch(self.replica, new)
                for start in range(0, len(live), _RESYNC_CHUNK):
                    await self.index.record(self.replica, new, live[start : start + _RESYNC_CHUNK])
            except INDEX_DOWN_ERRORS as exc:
                self.metrics.redis_error()
                logger.debug("replica %s: resync still failing: %s", self.replica, exc)
                return False
            old, self.epoch, self.dirty = self.epoch, new, False
            self.metrics.epoch_retired("resync")
            logger.info(
                "replica %s: index back; epoch %s -> %s with %d live blocks re-recorded",
                self.replica, old, new, len(live),
            )
        await self._announce(new)
        return True

    # ------------------------------------------------------------------ events

    async def apply_batch(self, batch: EventBatch) -> None:
        """Apply every event of ``batch`` in order."""
        async with self.lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    await self._stored(event)
                elif isinstance(event, BlockRemoved):
                    await self._removed(event)
                elif isinstance(event, AllBlocksCleared):
                    await self._new_epoch_locked("cleared", forget_hashes=False)
                else:  # pragma: no cover - the codec only yields the three kinds
                    continue
                self.metrics.event_applied(type(event).__name__)
        self.metrics.batch_lag(max(0.0, time.time() - batch.ts))

    async def absorb(self, batches: Sequence[EventBatch]) -> int:
        """Apply ``batches`` (an engine's history, replayed) to the hash map, then record the
        blocks left live in a few large writes: thousands of replayed batches cost one index
        write per 512 blocks instead of one per event. Returns the blocks recorded."""
        async with self.lock:
            for batch in batches:
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        self._map_stored(event)
                    elif isinstance(event, BlockRemoved):
                        for engine_hash in event.block_hashes:
                            self.hashes.evict(engine_hash)
                    elif isinstance(event, AllBlocksCleared):
                        self.hashes.mark_all_evicted()
                    else:  # pragma: no cover - the codec only yields the three kinds
                        continue
                    self.metrics.event_applied(type(event).__name__)
            epoch = self.epoch
            if epoch is None:
                raise RuntimeError("EventApplier.start() must run before events are applied")
            live = list(self.hashes.live_blocks())
            for start in range(0, len(live), _RESYNC_CHUNK):
                chunk = live[start : start + _RESYNC_CHUNK]
                if not await self._write(
                    "record", functools.partial(self.index.record, self.replica, epoch, chunk)
                ):
                    break  # dirty: the resync loop re-records the live set
            return len(live)

    def _skip(self, why: str, event: BlockStored | BlockRemoved) -> None:
        self.skipped_events += 1
        logger.debug("replica %s: skipping %s: %s", self.replica, type(event).__name__, why)

    def chain_of(self, event: BlockStored) -> list[BlockHash] | None:
        """fleetgate hashes of the blocks ``event`` stores, or None when it cannot be keyed."""
        if self.model is None:
            raise RuntimeError("EventApplier.model must be set before applying BlockStored")
        count = len(event.block_hashes)
        if event.block_size <= 0 or len(event.token_ids) != count * event.block_size:
            self._skip(
                f"{len(event.token_ids)} token ids for {count} blocks of {event.block_size}", event
            )
            return None
        if event.lora_id is not None and event.lora_name is None:
            # Legacy events name the adapter only by a per-process id: keying its blocks under
            # the base model would make base-model requests match adapter KV.
            self._skip("adapter block without lora_name (legacy encoding)", event)
            return None
        if event.parent_block_hash is None:
            parent = None
            seed = chain_seed(self.model, event.lora_name, cache_salt_of(event))
        else:
            parent = self.hashes.resolve(event.parent_block_hash)
            if parent is None:
                self._skip(f"unknown parent block {event.parent_block_hash!r}", event)
                return None
            # With a parent, the chain continues from its hash; the seed is only used at the root.
            seed = parent
        try:
            return extend_chain(parent, event.token_ids, event.block_size, seed)
        except ValueError as exc:
            # Token ids outside [0, 2**32) decode as ints but cannot be hashed: a corrupt event,
            # skipped like the others rather than raised out of the ingest loop.
            self._skip(str(exc), event)
            return None

    def _map_stored(self, event: BlockStored) -> list[BlockHash] | None:
        """Key ``event``'s blocks and remember them in the hash map; None when not tracked."""
        if event.group_idx not in (None, 0) or event.medium not in _TRACKED_MEDIUMS:
            return None  # other KV-cache groups / offload tiers repeat the same tokens
        chain = self.chain_of(event)
        if not chain:
            return None
        for engine_hash, block in zip(event.block_hashes, chain, strict=True):
            self.hashes.store(engine_hash, block)
        return chain

    async def _stored(self, event: BlockStored) -> None:
        chain = self._map_stored(event)
        if not chain:
            return
        epoch = self.epoch
        if epoch is None:
            raise RuntimeError("EventApplier.start() must run before events are applied")
        await self._write("record", lambda: self.index.record(self.replica, epoch, chain))

    async def _removed(self, event: BlockRemoved) -> None:
        if event.group_idx not in (None, 0) or event.medium not in _TRACKED_MEDIUMS:
            return
        gone: Sequence[BlockHash] = [
            block for block in map(self.hashes.evict, event.block_hashes) if block is not None
        ]
        if not gone:
            return
        epoch = self.epoch
        if epoch is None:
            raise RuntimeError("EventApplier.start() must run before events are applied")
        await self._write("remove", lambda: self.index.remove(self.replica, epoch, gone))
