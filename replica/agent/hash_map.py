"""The engine-hash -> fleetgate-hash map of one replica, bounded and LRU-ordered.

vLLM names blocks by its own hash; fleetgate's index is keyed by fleetgate's chained hash of the
tokens. The map lets the agent (1) resolve a ``BlockStored`` event's ``parent_block_hash`` to the
fleetgate hash its chain continues from, and (2) translate ``BlockRemoved`` hashes into index keys.

An entry stays after its block is evicted (``live=False``): the content hash is still correct, and
vLLM may later store a child whose parent was evicted in between. ``live`` entries are exactly the
blocks the engine holds now, which is what a resync after a Redis outage re-records.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from replica.kv_events import EngineHash
from routing.types import BlockHash


class EngineHashMap:
    """Bounded map ``EngineHash -> (BlockHash, live)``; the least recently used entry goes first.

    Overflow is counted, not hidden: an evicted live entry means a later ``BlockRemoved`` for it
    cannot be applied, so the index may keep a stale entry until the epoch changes.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self._entries: OrderedDict[EngineHash, tuple[BlockHash, bool]] = OrderedDict()
        #: Live entries dropped for capacity since creation.
        self.evicted_live = 0
        #: Entries the engine holds now (``live``), kept as they change rather than counted.
        self.live_count = 0

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, engine_hash: EngineHash) -> BlockHash | None:
        """The fleetgate hash of ``engine_hash`` (live or not), or None if unknown."""
        entry = self._entries.get(engine_hash)
        if entry is None:
            return None
        self._entries.move_to_end(engine_hash)
        return entry[0]

    def store(self, engine_hash: EngineHash, block: BlockHash) -> None:
        """Remember that ``engine_hash`` is ``block`` and that the engine holds it now."""
        old = self._entries.get(engine_hash)
        if old is None or not old[1]:
            self.live_count += 1
        self._entries[engine_hash] = (block, True)
        self._entries.move_to_end(engine_hash)
        while len(self._entries) > self.capacity:
            _, (_, live) = self._entries.popitem(last=False)
            self.evicted_live += int(live)
            self.live_count -= int(live)

    def evict(self, engine_hash: EngineHash) -> BlockHash | None:
        """Mark ``engine_hash`` no longer held; return its fleetgate hash if it was live."""
        entry = self._entries.get(engine_hash)
        if entry is None or not entry[1]:
            return None
        self._entries[engine_hash] = (entry[0], False)
        self.live_count -= 1
        return entry[0]

    def mark_all_evicted(self) -> None:
        """The engine dropped every block (``AllBlocksCleared``); hashes stay resolvable."""
        for key, (block, _) in self._entries.items():
            self._entries[key] = (block, False)
        self.live_count = 0

    def clear(self) -> None:
        """Forget everything (a new engine process: its hashes may mean nothing to us)."""
        self._entries.clear()
        self.live_count = 0

    def live_blocks(self) -> Iterator[BlockHash]:
        """fleetgate hashes of every block the engine holds now, oldest first."""
        return (block for block, live in self._entries.values() if live)
