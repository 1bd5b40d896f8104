"""A paged KV cache with vLLM's automatic prefix caching, block by block, no tensors.

Semantics follow vLLM's v1 block pool:

- Blocks hold ``block_size`` tokens. Only *full* blocks are cached, keyed by a chained hash: each
  block's hash covers its tokens and its parent's hash, and the chain's seed folds in the adapter
  and the tenant's ``cache_salt``, so equal text under another adapter or tenant never matches.
- Blocks are reference-counted: requests that share a prefix share its blocks while running.
- A block whose count drops to zero goes to the tail of the free queue but keeps its hash, so a
  later request can still hit it. New allocations take from the head, evicting the least recently
  freed block. A request frees its blocks tail first, so a prefix outlives its suffixes.
- Every block that becomes cached yields a ``BlockStored`` record; every eviction of a cached
  block a ``BlockRemoved`` record, in the order they happened.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import takewhile
from operator import is_not
from typing import Literal

import xxhash

#: ``lookup``'s test of a cache answer: a block id, not a miss.
_IS_BLOCK = partial(is_not, None)

_xxh3 = xxhash.xxh3_64_intdigest

#: ``(start, stop) -> token ids`` of one request, for the token_ids of a BlockStored record.
TokenSource = Callable[[int, int], list[int]]


@dataclass
class KVEventRecord:
    """What the engine stored or evicted, for vLLM-format KV events."""

    kind: Literal["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    #: The engine's own chained block hashes (seeded by adapter + salt, like vLLM's).
    block_hashes: list[int]
    parent_block_hash: int | None = None
    #: Spans all stored blocks (``len == len(block_hashes) × block_size`` for BlockStored).
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 16
    lora_name: str | None = None


def chain_seed(adapter: str | None, cache_salt: str | None) -> int:
    """The seed of a request's hash chain: distinct for every (adapter, salt) pair."""
    key = f"lora={adapter!r}\x00salt={cache_salt!r}".encode()
    return _xxh3(key)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids packed as little-endian uint32, the byte string block hashes are taken over."""
    try:
        return array("I", token_ids).tobytes()
    except OverflowError:
        raise ValueError("token ids must be integers in [0, 2**32)") from None


def extend_chain(
    hashes: list[int],
    data: bytes,
    block_size: int,
    num_blocks: int,
    seed: int,
    data_first_block: int = 0,
) -> None:
    """Append the hashes of full blocks ``len(hashes) .. num_blocks-1`` to ``hashes``.

    ``data`` is ``token_bytes`` of the tokens from block ``data_first_block`` on, covering at
    least up to block ``num_blocks``. Each hash is xxh3-64 of the block's bytes seeded by its
    parent's hash (the chain's ``seed`` for block 0), which chains the blocks.
    """
    width = 4 * block_size
    parent = hashes[-1] if hashes else seed
    for index in range(len(hashes), num_blocks):
        offset = (index - data_first_block) * width
        parent = _xxh3(data[offset : offset + width], parent)
        hashes.append(parent)


class KVCache:
    """Block allocation, sharing, caching and LRU eviction for one engine."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # An OrderedDict rather than a deque: a prefix hit must take a block out of the middle
        # of the free queue in O(1). Head = least recently freed = next to evict.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._blocks: dict[str, list[int]] = {}  # request id -> its block table
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks already cached
        self._events: list[KVEventRecord] = []

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached or not)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (held by requests or free to evict)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, as vLLM's ``kv_cache_usage_perc``."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_held(self, request_id: str) -> int:
        """How many blocks a request holds."""
        table = self._blocks.get(request_id)
        return len(table) if table else 0

    def blocks_of(self, request_id: str) -> list[int]:
        """The block table of a request (empty if it holds none)."""
        return list(self._blocks.get(request_id, ()))

    def is_cached(self, block_hash: int) -> bool:
        """True if a block with this hash is in the prefix cache."""
        return block_hash in self._cached

    def lookup(self, block_hashes: Iterable[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (nothing is claimed)."""
        if not self.enable_prefix_caching:
            return []
        # The scheduler asks again for a waiting request at each step while the cache is too
        # full to admit it: in C (map, takewhile), this loop was a sixth of a busy replay's time.
        return list(takewhile(_IS_BLOCK, map(self._cached.get, block_hashes)))

    # ------------------------------------------------------------------ allocation

    def allocate(self, request_id: str, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        """Make ``request_id`` hold blocks for ``num_tokens`` tokens; False if too few are free.

        ``prefix_blocks`` (from ``lookup``, only on a request's first allocation) are shared
        rather than allocated. Nothing changes when the answer is False.
        """
        table = self._blocks.get(request_id)
        held = len(table) if table else 0
        if not prefix_blocks and held * self.block_size >= num_tokens:
            return True  # the common decode step: the last block still has room
        needed = -(-num_tokens // self.block_size) - held - len(prefix_blocks)
        # Hit blocks that sit in the free queue stop being free once claimed.
        reclaimed = (
            list(map(self._ref_count.__getitem__, prefix_blocks)).count(0) if prefix_blocks else 0
        )
        if needed > len(self._free) - reclaimed:
            return False
        if table is None:
            table = self._blocks[request_id] = []
            self._num_cached[request_id] = len(prefix_blocks)
        for block in prefix_blocks:
            if self._ref_count[block] == 0:
                del self._free[block]
            self._ref_count[block] += 1
            table.append(block)
        if needed > 0:
            table.extend(self._take_free(needed))
        return True

    def _take_free(self, count: int) -> list[int]:
        taken: list[int] = []
        evicted: list[int] = []
        for _ in range(count):
            block, _none = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:
                del self._cached[old]
                self._hash[block] = None
                evicted.append(old)
            self._ref_count[block] = 1
            taken.append(block)
        if evicted:
            self._events.append(KVEventRecord("BlockRemoved", evicted, block_size=self.block_size))
        return taken

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first, so its prefix is evicted last."""
        table = self._blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if not table:
            return
        for block in reversed(table):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                self._free[block] = None

    # ------------------------------------------------------------------ caching

    def cache_full_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        num_full_blocks: int,
        token_ids_of: TokenSource,
        lora_name: str | None,
    ) -> None:
        """Register the request's blocks ``[already cached, num_full_blocks)`` in the cache.

        ``token_ids_of(start, stop)`` returns the request's tokens in that range (for the
        ``BlockStored`` record). A block whose hash is already cached elsewhere (two requests
        computed the same prefix at once) is left uncached: the first copy serves future hits.
        """
        if not self.enable_prefix_caching:
            return
        table = self._blocks[request_id]
        start = self._num_cached[request_id]
        if num_full_blocks <= start:
            return
        self._num_cached[request_id] = num_full_blocks
        run: list[int] = []
        run_start = start
        for index in range(start, num_full_blocks):
            block_hash = block_hashes[index]
            block = table[index]
            if block_hash in self._cached or self._hash[block] is not None:
                self._emit_stored(run, run_start, block_hashes, token_ids_of, lora_name)
                run, run_start = [], index + 1
                continue
            self._cached[block_hash] = block
            self._hash[block] = block_hash
            run.append(block_hash)
        self._emit_stored(run, run_start, block_hashes, token_ids_of, lora_name)

    def _emit_stored(
        self,
        run: list[int],
        run_start: int,
        block_hashes: Sequence[int],
        token_ids_of: TokenSource,
        lora_name: str | None,
    ) -> None:
        if not run:
            return
        bs = self.block_size
        self._events.append(
            KVEventRecord(
                "BlockStored",
                run,
                parent_block_hash=block_hashes[run_start - 1] if run_start > 0 else None,
                token_ids=token_ids_of(run_start * bs, (run_start + len(run)) * bs),
                block_size=bs,
                lora_name=lora_name,
            )
        )

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's ``reset_prefix_cache``); False if blocks are in use."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self._events.append(KVEventRecord("AllBlocksCleared", [], block_size=self.block_size))
        return True

    def take_events(self) -> list[KVEventRecord]:
        """The records since the last call, oldest first."""
        events, self._events = self._events, []
        return events
