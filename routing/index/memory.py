"""In-process ``BlockIndex``: a bounded LRU of block hashes, for one gateway or the simulator.

Layout: an ``OrderedDict`` from block hash to ``{replica: holding}``, oldest block first. A
holding carries the epoch it was recorded under and, for speculative entries, an expiry time.

Liveness is decided when an entry is *read*, never by scanning:

* an entry matches only if its epoch is the replica's current epoch, so ``retire_epoch`` and
  ``set_epoch`` hide every entry of the old incarnation at once (O(1));
* a speculative entry matches only until its expiry;
* a replica that has heartbeated and then missed its deadline matches nothing until it
  heartbeats again (replicas that never heartbeat are not held to one, unless
  ``require_heartbeat`` is set).

Dead holdings met during a lookup are dropped on the spot; the LRU bound removes the rest.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from routing.contracts import IndexStats
from routing.index._validate import check_blocks, check_epoch, check_replica, check_ttl
from routing.types import BlockHash, Epoch, ReplicaId

__all__ = ["MemoryBlockIndex"]


@dataclass(slots=True)
class _Holding:
    """One replica's claim to one block."""

    epoch: Epoch
    #: Clock time after which a speculative entry is dead; ``None`` for engine-confirmed ones.
    expires_at: float | None


class MemoryBlockIndex:
    """A ``BlockIndex`` held in this process, bounded to ``max_entries`` blocks (LRU).

    ``max_entries`` counts distinct block hashes; each costs about 340 bytes with one replica
    holding it, plus about 50 bytes per further replica (docs/index.md). ``clock`` is
    injectable so tests can move time.
    """

    def __init__(
        self,
        max_entries: int = 1_000_000,
        *,
        clock: Callable[[], float] = time.monotonic,
        require_heartbeat: bool = False,
    ) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"max_entries must be a positive integer (got {max_entries!r})")
        self._max_entries = max_entries
        self._clock = clock
        self._require_heartbeat = require_heartbeat
        self._blocks: OrderedDict[BlockHash, dict[ReplicaId, _Holding]] = OrderedDict()
        #: The live epoch of each known replica; ``None`` once that epoch was retired and no
        #: new one declared. A replica absent here adopts the epoch of its first ``record``.
        self._epochs: dict[ReplicaId, Epoch | None] = {}
        self._heartbeat_deadlines: dict[ReplicaId, float] = {}
        self._evictions = 0

    # ------------------------------------------------------------------ epochs and liveness

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Declare ``epoch`` the live incarnation of ``replica``; entries of other epochs die."""
        check_replica(replica)
        check_epoch(epoch)
        self._epochs[replica] = epoch

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Retire ``epoch``: if it is the live one, the replica matches nothing until a new one.

        Retiring an epoch that is not the live one changes nothing: its entries are already dead.
        """
        check_replica(replica)
        check_epoch(epoch)
        if self._epochs.get(replica) == epoch:
            self._epochs[replica] = None

    async def heartbeat(self, replica: ReplicaId, ttl_s: float) -> None:
        """Keep ``replica``'s entries matching for ``ttl_s`` more seconds."""
        check_replica(replica)
        check_ttl(ttl_s, optional=False)
        self._heartbeat_deadlines[replica] = self._clock() + ttl_s

    def _heartbeat_ok(self, replica: ReplicaId, now: float) -> bool:
        """Whether ``replica``'s heartbeat (if it is held to one) lets its entries match now."""
        deadline = self._heartbeat_deadlines.get(replica)
        if deadline is None:
            return not self._require_heartbeat
        return deadline > now

    # ------------------------------------------------------------------ writes

    async def record(
        self,
        replica: ReplicaId,
        epoch: Epoch,
        blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        """Record that ``replica`` at ``epoch`` holds ``blocks`` (speculatively if ``ttl_s``).

        Writes for an epoch that is not the replica's live one are dropped: a late event or a
        stale routing decision must not overwrite the live incarnation's entries. A replica seen
        for the first time adopts ``epoch``. A speculative write never downgrades an
        engine-confirmed entry of the same epoch.
        """
        check_replica(replica)
        check_epoch(epoch)
        check_ttl(ttl_s)
        check_blocks(blocks)
        if not blocks:
            return  # nothing to hold: no epoch is adopted either (as in the Redis backend)
        if replica not in self._epochs:
            self._epochs[replica] = epoch
        if self._epochs[replica] != epoch:
            return
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        index = self._blocks
        for block in blocks:
            holders = index.get(block)
            if holders is None:
                holders = index[block] = {}
            else:
                index.move_to_end(block)
            held = holders.get(replica)
            if (
                expires_at is not None
                and held is not None
                and held.epoch == epoch
                and held.expires_at is None
            ):
                continue  # keep the engine's word over our own guess
            holders[replica] = _Holding(epoch, expires_at)
        self._evict_overflow()

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        """Forget that ``replica`` at ``epoch`` holds ``blocks``; other epochs' entries stay."""
        check_replica(replica)
        check_epoch(epoch)
        check_blocks(blocks)
        for block in blocks:
            holders = self._blocks.get(block)
            if holders is None:
                continue
            held = holders.get(replica)
            if held is not None and held.epoch == epoch:
                del holders[replica]
                if not holders:
                    del self._blocks[block]

    def _evict_overflow(self) -> None:
        while len(self._blocks) > self._max_entries:
            self._blocks.popitem(last=False)
            self._evictions += 1

    # ------------------------------------------------------------------ lookup

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Longest live prefix of ``chain`` per replica, in blocks; replicas with 0 omitted.

        Walks the chain once and stops at the first block that no still-matching replica holds,
        so the cost is O(matched blocks x replicas holding them), not O(chain).
        """
        now = self._clock()
        epochs = self._epochs
        heartbeat_ok: dict[ReplicaId, bool] = {}
        depths: dict[ReplicaId, int] = {}
        running: set[ReplicaId] | None = None  # replicas whose match is still unbroken
        matched = 0
        index = self._blocks
        for block in chain:
            holders = index.get(block)
            if holders is None:
                break
            still: set[ReplicaId] = set()
            dead: list[ReplicaId] | None = None
            for replica in holders if running is None else running:
                held = holders.get(replica)
                if held is None:
                    continue
                expires_at = held.expires_at
                if held.epoch != epochs.get(replica) or (
                    expires_at is not None and expires_at <= now
                ):
                    # An old epoch or an expired guess can never match again: drop it now.
                    dead = dead or []
                    dead.append(replica)
                    continue
                alive = heartbeat_ok.get(replica)
                if alive is None:
                    # A replica missing heartbeats matches nothing, but its entries may return.
                    alive = heartbeat_ok[replica] = self._heartbeat_ok(replica, now)
                if alive:
                    still.add(replica)
            if dead:
                for replica in dead:
                    del holders[replica]
                if not holders:
                    del index[block]
            if not still:
                break
            index.move_to_end(block)  # a hit keeps the block young (LRU)
            if running is not None and len(still) != len(running):
                for replica in running - still:
                    depths[replica] = matched
            running = still
            matched += 1
        for replica in running or ():
            depths[replica] = matched
        return depths

    # ------------------------------------------------------------------ admin

    async def stats(self) -> IndexStats:
        """Blocks held, replicas with a live epoch, the bound and evictions so far."""
        live_replicas = sum(1 for epoch in self._epochs.values() if epoch is not None)
        return IndexStats(
            backend="memory",
            entries=len(self._blocks),
            replicas=live_replicas,
            max_entries=self._max_entries,
            extra={"evictions": self._evictions},
        )

    async def close(self) -> None:
        """Nothing to release; present for the protocol."""
