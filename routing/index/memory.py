"""In-process ``BlockIndex``: a bounded LRU of block hashes, for one gateway or the simulator.

Layout: every live *incarnation* (a replica at one epoch) owns one bit. An ``OrderedDict`` maps
each block hash, oldest first, to an int bitmask of the incarnations holding it
engine-confirmed; blocks with speculative entries also map, on the side, to an immutable
*speculative state*: the OR of the guessing incarnations' bits, the earliest expiry among them,
and the guesses themselves (one per replica). States are shared: one write gives every block it
touches in the same state the same new state (a transition memoised for the call), so the blocks
of a prompt that were written by the same writes hold one state object, not a dict each (and,
being exact tuples of ints, floats and strings, states are soon untracked by the garbage
collector; see ``_SpecState``).

A lookup is then one big-int AND per block, whatever the number of replicas::

    running = live & mask[b0]
    nxt = running & mask[bi]        # replicas in running & ~nxt stop at depth i

so it costs O(matched blocks), not O(matched blocks x replicas holding them). A block with a
speculative state ORs in the state's bits as long as the lookup's clock is before the state's
earliest expiry and none of its bits is dead (checked once per state object, not per block);
otherwise the lookup drops the expired or dead guesses first.

Liveness is decided when an entry is *read*, never by scanning:

* ``live`` holds only the bits of each replica's live incarnation, so ``retire_epoch`` and
  ``set_epoch`` hide every entry of the old incarnation at once (one bit cleared);
* a speculative entry matches only until its expiry, and is then reclaimed (below);
* a replica that has heartbeated and then missed its deadline matches nothing until it
  heartbeats again (replicas that never heartbeat are not held to one, unless
  ``require_heartbeat`` is set).

Bits of dead incarnations stay in block masks until a lookup or a write meets them, or until
*compaction*: once ``compact_after_dead`` incarnations are dead, one pass over the blocks clears
their bits and frees them for reuse, so masks stay about as wide as the live fleet.

Expired speculative entries are *reclaimed* without a background task: each speculative
``record`` pushes one item (its expiry, its blocks) onto a heap ordered by expiry, and every
``record`` and ``match`` first pops expired items, a bounded number of blocks per call
(``record``: ``reclaim_step`` + its own length, so reclamation keeps pace with the writes;
``match``: ``reclaim_step``). A block left with neither a confirmed nor a speculative entry
leaves the LRU map. Without engine-confirmed writes, the index thus holds about
write rate x TTL blocks, instead of growing until ``max_entries`` evicts them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from routing.contracts import IndexStats
from routing.index._validate import check_blocks, check_epoch, check_replica, check_ttl
from routing.types import BlockHash, Epoch, ReplicaId

__all__ = ["MemoryBlockIndex"]


# Guesses and states are exact tuples with named field positions, not NamedTuples: the garbage
# collector stops tracking a tuple that holds only ints, floats, strings and such tuples, but only
# an exact tuple. As NamedTuples, about three more objects per live speculative write stayed
# tracked (12,000 at 4,000 live writes), each walked by every full collection
# (docs/benchmarks/routing-decision.md, issue 16).

#: One speculative write's entry, shared by every block it wrote: (the writing incarnation's bit
#: value, expiry on the index clock, replica). Reclamation tells a write's own entry from a newer
#: one by identity (``is``), never by value.
_Guess = tuple[int, float, ReplicaId]
_GUESS_BIT, _GUESS_UNTIL, _GUESS_REPLICA = 0, 1, 2

#: The speculative entries of a block, immutable and shared by every block in that state: (OR of
#: the guesses' bit values, the earliest expiry among them, the guesses, at most one per
#: replica). Never empty: a block whose last guess goes has no state.
_SpecState = tuple[int, float, tuple[_Guess, ...]]
_STATE_BITS, _STATE_EARLIEST, _STATE_GUESSES = 0, 1, 2


class _Incarnation(NamedTuple):
    """A replica at one epoch: the owner of one incarnation bit.

    Equal to (and hashed as) the plain ``(replica, epoch)`` tuple, which lookups build instead.
    """

    replica: ReplicaId
    epoch: Epoch


class _PendingReclaim:
    """One speculative write awaiting reclamation: an item of the index's expiry heap.

    Ordered by expiry, then by write order; ``cursor`` is how far reclamation has walked
    ``blocks`` (a walk stops at its budget and resumes there).
    """

    __slots__ = ("blocks", "cursor", "expiry", "guess", "sequence")

    def __init__(self, guess: _Guess, sequence: int, blocks: tuple[BlockHash, ...]) -> None:
        self.expiry = guess[_GUESS_UNTIL]
        self.sequence = sequence
        #: The guess it wrote, shared by its blocks (reclamation drops only that object).
        self.guess = guess
        self.blocks = blocks
        self.cursor = 0

    def __lt__(self, other: _PendingReclaim) -> bool:
        if self.expiry != other.expiry:
            return self.expiry < other.expiry
        return self.sequence < other.sequence


_MAX_U64 = 2**64 - 1
_INT_ONLY = {int}


def _checked_blocks(blocks: Sequence[BlockHash]) -> None:
    """``check_blocks``, with a fast path for the usual list or tuple of plain ints.

    Element by element in Python, ``check_blocks`` was a sizeable share of a ``record``; the fast
    path checks types and range in C. Anything it does not accept goes to ``check_blocks``,
    which raises the precise error (or accepts, e.g. int subclasses), so errors are unchanged.
    """
    kind = type(blocks)
    if (
        (kind is list or kind is tuple)
        and blocks
        and set(map(type, blocks)) == _INT_ONLY
        and min(blocks) >= 0
        and max(blocks) <= _MAX_U64
    ):
        return
    check_blocks(blocks)


def _state_of(guesses: tuple[_Guess, ...]) -> _SpecState | None:
    """The speculative state holding ``guesses`` (``None`` if there are none)."""
    if not guesses:
        return None
    bits = 0
    earliest = math.inf
    for value, until, _ in guesses:
        bits |= value
        if until < earliest:
            earliest = until
    return (bits, earliest, guesses)


def _with_guess(state: _SpecState | None, guess: _Guess) -> _SpecState:
    """``state`` with ``guess`` replacing its replica's guess, if any (of any incarnation)."""
    if state is None:
        return (guess[_GUESS_BIT], guess[_GUESS_UNTIL], (guess,))
    replica = guess[_GUESS_REPLICA]
    new = _state_of((*[g for g in state[_STATE_GUESSES] if g[_GUESS_REPLICA] != replica], guess))
    assert new is not None
    return new


def _without_replica(state: _SpecState, replica: ReplicaId) -> _SpecState | None:
    """``state`` less ``replica``'s guess (``state`` itself, unchanged, if it has none)."""
    guesses = state[_STATE_GUESSES]
    kept = tuple(g for g in guesses if g[_GUESS_REPLICA] != replica)
    return state if len(kept) == len(guesses) else _state_of(kept)


def _without_incarnation(state: _SpecState, replica: ReplicaId, value: int) -> _SpecState | None:
    """``state`` less ``replica``'s guess if it is of the incarnation whose bit is ``value``."""
    guesses = state[_STATE_GUESSES]
    kept = tuple(
        g for g in guesses if not (g[_GUESS_BIT] == value and g[_GUESS_REPLICA] == replica)
    )
    return state if len(kept) == len(guesses) else _state_of(kept)


def _without_guess(state: _SpecState, guess: _Guess) -> _SpecState | None:
    """``state`` less this very ``guess`` object (``state`` itself if it does not hold it)."""
    guesses = state[_STATE_GUESSES]
    kept = tuple(g for g in guesses if g is not guess)
    return state if len(kept) == len(guesses) else _state_of(kept)


def _without_stale(state: _SpecState, now: float, dead: int) -> _SpecState | None:
    """``state`` less its guesses expired at ``now`` or of dead incarnations (itself if none)."""
    if now < state[_STATE_EARLIEST] and not state[_STATE_BITS] & dead:
        return state
    return _state_of(
        tuple(
            g for g in state[_STATE_GUESSES] if now < g[_GUESS_UNTIL] and not g[_GUESS_BIT] & dead
        )
    )


class _Transitions:
    """Memoises one state transition within a call: old state object -> new state object.

    Keyed by identity (the old state is kept alive here so its id cannot be reused meanwhile);
    the blocks a call touches mostly share a handful of states, so each is computed once.
    """

    __slots__ = ("_last_new", "_last_old", "_memo", "_step")

    def __init__(self, step: Callable[[_SpecState], _SpecState | None]) -> None:
        self._step = step
        self._last_old: object = _NO_STATE
        self._last_new: _SpecState | None = None
        self._memo: dict[int, tuple[_SpecState, _SpecState | None]] = {}

    def __call__(self, state: _SpecState) -> _SpecState | None:
        if state is self._last_old:
            return self._last_new
        hit = self._memo.get(id(state))
        if hit is None:
            new = self._step(state)
            self._memo[id(state)] = (state, new)
        else:
            new = hit[1]
        self._last_old, self._last_new = state, new
        return new

    def apply(
        self, spec_blocks: dict[BlockHash, _SpecState], block_hash: BlockHash, state: _SpecState
    ) -> _SpecState | None:
        """Move ``block_hash`` from ``state`` to its new state in ``spec_blocks``; the new one.

        A block left without guesses leaves ``spec_blocks``; an unchanged state is not rewritten.
        """
        new = self(state)
        if new is None:
            del spec_blocks[block_hash]
        elif new is not state:
            spec_blocks[block_hash] = new
        return new


_NO_STATE = object()


class MemoryBlockIndex:
    """A ``BlockIndex`` held in this process, bounded to ``max_entries`` blocks (LRU).

    ``max_entries`` counts distinct block hashes (about 130 bytes each, docs/index.md).
    ``clock`` is injectable so tests can move time. ``compact_after_dead`` is how many dead
    incarnations may keep their bits before one compaction pass frees them. ``reclaim_step`` is
    how many blocks of expired speculative writes a ``match`` reclaims at most (a ``record``
    reclaims that many plus its own length).
    """

    def __init__(
        self,
        max_entries: int = 1_000_000,
        *,
        clock: Callable[[], float] = time.monotonic,
        require_heartbeat: bool = False,
        compact_after_dead: int = 64,
        reclaim_step: int = 64,
    ) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"max_entries must be a positive integer (got {max_entries!r})")
        if (
            isinstance(compact_after_dead, bool)
            or not isinstance(compact_after_dead, int)
            or compact_after_dead <= 0
        ):
            raise ValueError(
                f"compact_after_dead must be a positive integer (got {compact_after_dead!r})"
            )
        if isinstance(reclaim_step, bool) or not isinstance(reclaim_step, int) or reclaim_step <= 0:
            raise ValueError(f"reclaim_step must be a positive integer (got {reclaim_step!r})")
        self._max_entries = max_entries
        self._reclaim_step = reclaim_step
        self._clock = clock
        self._require_heartbeat = require_heartbeat
        self._compact_after_dead = compact_after_dead
        # Block hash -> bits of the incarnations holding it engine-confirmed (0 if only guessed).
        # Plain ints, not objects: a million blocks add nothing for the garbage collector to
        # walk, which would otherwise stall every process-wide collection for milliseconds.
        self._blocks: OrderedDict[BlockHash, int] = OrderedDict()
        #: Speculative state, only for the blocks that have guesses; states are shared by blocks.
        self._spec: dict[BlockHash, _SpecState] = {}
        #: Speculative writes by expiry (a heap, earliest first), for reclamation. One
        #: item per ``record`` call, not per block: pushing costs O(log writes) per call.
        self._expiring: list[_PendingReclaim] = []
        self._sequence = itertools.count()
        #: Blocks of the writes in ``_expiring``: at most twice ``max_entries`` (the index holds
        #: fewer guesses than that), past which the earliest writes are left to lookups and LRU.
        self._expiring_blocks = 0
        self._reclaimed = 0
        #: The live epoch of each known replica; ``None`` once that epoch was retired and no
        #: new one declared. A replica absent here adopts the epoch of its first ``record``.
        self._epochs: dict[ReplicaId, Epoch | None] = {}
        self._heartbeat_deadlines: dict[ReplicaId, float] = {}
        self._evictions = 0
        self._compactions = 0
        # Incarnation bits. A bit is allocated when an epoch becomes live, turns dead when the
        # epoch is retired or replaced, and is freed only by compaction, once no block has it.
        self._bit_of: dict[tuple[ReplicaId, Epoch], int] = {}
        #: Bit -> its incarnation (``None``: free).
        self._owner: list[_Incarnation | None] = []
        self._free_bits: list[int] = []  # a heap: the lowest free bit first keeps masks narrow
        #: All allocated bits (live and dead) of each replica: a write replaces the replica's
        #: entry of any other incarnation in place, as one entry per replica per block.
        self._replica_bits: dict[ReplicaId, int] = {}
        self._live_mask = 0
        self._dead_mask = 0
        # The live mask less replicas that missed their heartbeat, cached until a heartbeat
        # deadline passes or an epoch/heartbeat changes (``None`` = recompute).
        self._match_mask: int | None = None
        self._match_mask_until = math.inf

    # ------------------------------------------------------------------ incarnation bits

    def _make_live(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Make ``epoch`` the replica's live incarnation, giving it a bit (reused if it has one)."""
        current = self._epochs.get(replica)
        if current == epoch:
            return
        if current is not None:
            self._kill(replica, current)
        self._epochs[replica] = epoch
        key = _Incarnation(replica, epoch)
        bit = self._bit_of.get(key)
        if bit is None:
            # Never reusing an epoch number is the caller's rule (docs/index.md); if one is
            # reused before compaction, its old bit (and entries) simply come back.
            bit = heapq.heappop(self._free_bits) if self._free_bits else len(self._owner)
            if bit == len(self._owner):
                self._owner.append(key)
            else:
                self._owner[bit] = key
            self._bit_of[key] = bit
            self._replica_bits[replica] = self._replica_bits.get(replica, 0) | (1 << bit)
        value = 1 << bit
        self._live_mask |= value
        self._dead_mask &= ~value
        self._match_mask = None

    def _kill(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Turn the incarnation's bit dead: it stops matching now and is freed by compaction."""
        value = 1 << self._bit_of[(replica, epoch)]
        self._live_mask &= ~value
        self._dead_mask |= value
        self._match_mask = None
        if self._dead_mask.bit_count() >= self._compact_after_dead:
            self._compact()

    def _compact(self) -> None:
        """Clear every dead bit from every block, drop emptied blocks, and free the bits.

        One pass over the index (O(blocks)); it runs once per ``compact_after_dead`` retired
        incarnations, so its cost per retirement is O(blocks / compact_after_dead).
        """
        dead = self._dead_mask
        if not dead:
            return
        keep = ~dead
        index = self._blocks
        spec_blocks = self._spec
        # At a clock of -inf no guess has expired: only dead ones go (expiry is left to lookups
        # and reclamation, as before).
        drop_dead = _Transitions(lambda state: _without_stale(state, -math.inf, dead))
        for block_hash, state in list(spec_blocks.items()):
            drop_dead.apply(spec_blocks, block_hash, state)
        empty: list[BlockHash] = []
        # Rewriting a value in place keeps the LRU order (only insertion and move_to_end move).
        for block_hash, mask in index.items():
            if mask & dead:
                mask &= keep
                index[block_hash] = mask
            if not mask and block_hash not in spec_blocks:
                empty.append(block_hash)
        for block_hash in empty:
            del index[block_hash]
        remaining = dead
        while remaining:
            low = remaining & -remaining
            remaining ^= low
            bit = low.bit_length() - 1
            key = self._owner[bit]
            assert key is not None
            self._owner[bit] = None
            del self._bit_of[key]
            self._replica_bits[key.replica] &= ~low
            heapq.heappush(self._free_bits, bit)
        self._dead_mask = 0
        self._compactions += 1

    def _reclaim(self, now: float, budget: int) -> None:
        """Drop expired speculative entries, walking at most ``budget`` blocks of expired writes.

        Each write's blocks are walked once in all (a cursor remembers where a walk stopped), so
        the cost is O(1) amortised per block written. An entry rewritten since (a newer guess, a
        confirmed write) or already dropped (lookup, LRU, compaction) is not the write's own
        guess object any more and is left alone.
        """
        heap = self._expiring
        index, spec_blocks = self._blocks, self._spec
        live = ~self._dead_mask
        reclaimed = 0
        while heap and budget > 0:
            item = heap[0]
            if item.expiry > now:
                break
            guess = item.guess
            drop = _Transitions(lambda state, guess=guess: _without_guess(state, guess))
            blocks = item.blocks
            start = item.cursor
            end = min(len(blocks), start + budget)
            budget -= end - start
            for position in range(start, end):
                block_hash = blocks[position]
                state = spec_blocks.get(block_hash)
                if state is None:
                    continue
                new = drop(state)
                if new is state:
                    continue
                reclaimed += 1
                if new is not None:
                    spec_blocks[block_hash] = new
                    continue
                del spec_blocks[block_hash]
                mask = index.get(block_hash)
                if mask is not None and not mask & live:  # no confirmed entry that may match
                    del index[block_hash]
            if end < len(blocks):
                item.cursor = end
                break
            heapq.heappop(heap)
            self._expiring_blocks -= len(blocks)
        self._reclaimed += reclaimed

    def _queue_for_reclaim(self, item: _PendingReclaim) -> None:
        """Queue a speculative write for reclamation, within twice the ``max_entries`` bound."""
        heap = self._expiring
        heapq.heappush(heap, item)
        self._expiring_blocks += len(item.blocks)
        while self._expiring_blocks > 2 * self._max_entries and len(heap) > 1:
            dropped = heapq.heappop(heap)
            self._expiring_blocks -= len(dropped.blocks)

    def _current_match_mask(self, now: float) -> int:
        """Bits of the incarnations that may match now: live and not behind on heartbeats."""
        if self._match_mask is not None and now < self._match_mask_until:
            return self._match_mask
        mask = 0
        until = math.inf
        deadlines = self._heartbeat_deadlines
        for replica, epoch in self._epochs.items():
            if epoch is None:
                continue
            deadline = deadlines.get(replica)
            if deadline is None:
                if self._require_heartbeat:
                    continue
            elif deadline <= now:
                continue  # silent: its entries come back with its next heartbeat
            else:
                until = min(until, deadline)
            mask |= 1 << self._bit_of[(replica, epoch)]
        self._match_mask, self._match_mask_until = mask, until
        return mask

    # ------------------------------------------------------------------ epochs and liveness

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Declare ``epoch`` the live incarnation of ``replica``; entries of other epochs die."""
        self.set_epoch_now(replica, epoch)

    def set_epoch_now(self, replica: ReplicaId, epoch: Epoch) -> None:
        """``set_epoch`` without a coroutine (the mirror applies stream events with it)."""
        check_replica(replica)
        check_epoch(epoch)
        self._make_live(replica, epoch)

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Retire ``epoch``: if it is the live one, the replica matches nothing until a new one.

        Retiring an epoch that is not the live one changes nothing: its entries are already dead.
        """
        self.retire_epoch_now(replica, epoch)

    def retire_epoch_now(self, replica: ReplicaId, epoch: Epoch) -> None:
        """``retire_epoch`` without a coroutine."""
        check_replica(replica)
        check_epoch(epoch)
        if self._epochs.get(replica) == epoch:
            self._epochs[replica] = None
            self._kill(replica, epoch)

    async def heartbeat(self, replica: ReplicaId, ttl_s: float) -> None:
        """Keep ``replica``'s entries matching for ``ttl_s`` more seconds."""
        self.heartbeat_now(replica, ttl_s)

    def heartbeat_now(self, replica: ReplicaId, ttl_s: float) -> None:
        """``heartbeat`` without a coroutine."""
        check_replica(replica)
        check_ttl(ttl_s, optional=False)
        now = self._clock()
        deadline = now + ttl_s
        previous = self._heartbeat_deadlines.get(replica)
        self._heartbeat_deadlines[replica] = deadline
        # A later deadline for a replica that is matching leaves the cached mask right (its
        # validity ends no later than before); anything else must recompute it.
        if previous is None or previous <= now or deadline < previous:
            self._match_mask = None

    # ------------------------------------------------------------------ writes

    async def record(
        self,
        replica: ReplicaId,
        epoch: Epoch,
        blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        """Record that ``replica`` at ``epoch`` holds ``blocks`` (speculatively if ``ttl_s``).

        The ``BlockIndex`` protocol's form of ``record_now`` (it never waits).
        """
        self.record_now(replica, epoch, blocks, ttl_s)

    def record_now(
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
        _checked_blocks(blocks)
        if not blocks:
            return  # nothing to hold: no epoch is adopted either (as in the Redis backend)
        now = self._clock() if ttl_s is not None or self._expiring else 0.0
        if self._expiring and self._expiring[0].expiry <= now:
            self._reclaim(now, self._reclaim_step + len(blocks))
        if replica not in self._epochs:
            self._make_live(replica, epoch)
        if self._epochs[replica] != epoch:
            return
        value = 1 << self._bit_of[(replica, epoch)]
        # The replica's other incarnations' entries are replaced in place (one per block).
        others = self._replica_bits[replica] & ~value
        keep = ~others
        index = self._blocks
        spec_blocks = self._spec
        if ttl_s is None:
            drop = _Transitions(lambda state: _without_replica(state, replica))
            for block_hash in blocks:
                mask = index.get(block_hash)
                if mask is None:
                    index[block_hash] = value
                    continue
                index.move_to_end(block_hash)
                index[block_hash] = (mask & keep) | value
                if spec_blocks:
                    state = spec_blocks.get(block_hash)
                    if state is not None:
                        drop.apply(spec_blocks, block_hash, state)
        else:
            until = now + ttl_s
            guess: _Guess = (value, until, replica)
            blocks = tuple(blocks)  # kept for reclamation: the caller may reuse its list
            self._queue_for_reclaim(_PendingReclaim(guess, next(self._sequence), blocks))
            fresh: _SpecState = (value, until, (guess,))  # the state of a block guessed only now
            add = _Transitions(lambda state: _with_guess(state, guess))
            # The last transition, inline: consecutive blocks nearly always share their state.
            last_old: _SpecState | None = None
            last_new = fresh
            get, move_to_end, spec_get = index.get, index.move_to_end, spec_blocks.get
            for block_hash in blocks:
                mask = get(block_hash)
                if mask is None:
                    # A block absent from the LRU map has no speculative state either.
                    index[block_hash] = 0
                    spec_blocks[block_hash] = fresh
                    continue
                move_to_end(block_hash)
                if mask & value:
                    continue  # keep the engine's word over our own guess
                if mask & others:
                    index[block_hash] = mask & keep
                state = spec_get(block_hash)
                if state is not last_old:
                    last_old = state
                    last_new = fresh if state is None else add(state)
                spec_blocks[block_hash] = last_new
        self._evict_overflow()

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        """Forget that ``replica`` at ``epoch`` holds ``blocks``; other epochs' entries stay."""
        self.remove_now(replica, epoch, blocks)

    def remove_now(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        """``remove`` without a coroutine."""
        check_replica(replica)
        check_epoch(epoch)
        _checked_blocks(blocks)
        bit = self._bit_of.get((replica, epoch))
        if bit is None:
            return  # no bit, so no entry of that incarnation anywhere
        value = 1 << bit
        index = self._blocks
        spec_blocks = self._spec
        # Only the guess of this incarnation goes (the replica's entry of another one stays).
        drop = _Transitions(lambda state: _without_incarnation(state, replica, value))
        for block_hash in blocks:
            mask = index.get(block_hash)
            if mask is None:
                continue
            mask &= ~value
            index[block_hash] = mask
            state = spec_blocks.get(block_hash)
            if state is not None:
                state = drop.apply(spec_blocks, block_hash, state)
            if not mask and state is None:
                del index[block_hash]

    def _evict_overflow(self) -> None:
        index, spec_blocks = self._blocks, self._spec
        while len(index) > self._max_entries:
            block_hash, _ = index.popitem(last=False)
            if spec_blocks:
                spec_blocks.pop(block_hash, None)
            self._evictions += 1

    # ------------------------------------------------------------------ lookup

    def _holders(
        self,
        block_hash: BlockHash,
        mask: int,
        state: _SpecState | None,
        drop_stale: Callable[[_SpecState], _SpecState | None],
    ) -> int:
        """The block's holder bits with live speculative entries OR-ed in; drops dead entries.

        The slow path of ``match``: only called when the block has dead confirmed bits, or a
        speculative state with an expired guess or a dead bit (uncommon). ``drop_stale`` is the
        lookup's memoised ``_without_stale`` transition.
        """
        dead = self._dead_mask
        if mask & dead:
            mask &= ~dead  # an old incarnation can never match again: drop it now
            self._blocks[block_hash] = mask
        holders = mask
        if state is not None:
            new = drop_stale(state)
            if new is None:
                del self._spec[block_hash]
            else:
                if new is not state:
                    self._spec[block_hash] = new
                holders |= new[_STATE_BITS]
        if not holders:
            del self._blocks[block_hash]
        return holders

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Longest live prefix of ``chain`` per replica (``match_now``; it never waits)."""
        return self.match_now(chain)

    def match_now(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Longest live prefix of ``chain`` per replica, in blocks; replicas with 0 omitted.

        Synchronous: the engine and the gateway call it directly, with no coroutine or timer.

        Walks the chain once, one bitmask AND per block, and stops at the first block that no
        still-matching replica holds: O(matched blocks), whatever the number of replicas.
        """
        if not chain:
            return {}
        now = self._clock()
        if self._expiring and self._expiring[0].expiry <= now:
            self._reclaim(now, self._reclaim_step)
        running = self._current_match_mask(now)
        if not running:
            return {}
        index = self._blocks
        get = index.get
        move_to_end = index.move_to_end
        spec_get = self._spec.get
        dead = self._dead_mask
        owner = self._owner
        depths: dict[ReplicaId, int] = {}
        matched = 0
        # The last speculative state found usable as it is (nothing expired, no dead bit): the
        # blocks of a prompt mostly share one state, so it is checked once, not once per block.
        usable: object = _NO_STATE
        usable_bits = 0  # its bits, read once (an attribute read per block costs more)
        stale: _Transitions | None = None  # made on first need: most lookups never need it
        for block_hash in chain:
            mask = get(block_hash)
            if mask is None:
                break
            state = spec_get(block_hash)
            if mask & dead or (
                state is not None
                and state is not usable
                and not (now < state[_STATE_EARLIEST] and not state[_STATE_BITS] & dead)
            ):
                if stale is None:
                    stale = _Transitions(lambda old: _without_stale(old, now, dead))
                mask = self._holders(block_hash, mask, state, stale)
            elif state is not None:
                if state is not usable:
                    usable = state
                    usable_bits = state[_STATE_BITS]
                mask |= usable_bits
            still = running & mask
            if not still:
                break
            move_to_end(block_hash)  # a hit keeps the block young (LRU)
            if still != running:
                # Replicas live but lacking the first block simply never start (depth 0).
                ended = running & ~still if matched else 0
                while ended:  # replicas whose prefix ends here
                    low = ended & -ended
                    ended ^= low
                    depths[owner[low.bit_length() - 1].replica] = matched  # type: ignore[union-attr]
                running = still
            matched += 1
        if matched:
            while running:
                low = running & -running
                running ^= low
                depths[owner[low.bit_length() - 1].replica] = matched  # type: ignore[union-attr]
        return depths

    # ------------------------------------------------------------------ admin

    async def stats(self) -> IndexStats:
        """Blocks held, replicas with a live epoch, the bound, evictions and incarnation bits."""
        live_replicas = sum(1 for epoch in self._epochs.values() if epoch is not None)
        return IndexStats(
            backend="memory",
            entries=len(self._blocks),
            replicas=live_replicas,
            max_entries=self._max_entries,
            extra={
                "evictions": self._evictions,
                "incarnation_bits": len(self._bit_of),
                "dead_incarnation_bits": self._dead_mask.bit_count(),
                "compactions": self._compactions,
                "speculative_blocks": len(self._spec),
                "reclaimed": self._reclaimed,
                "reclaim_queue_blocks": self._expiring_blocks,
            },
        )

    async def close(self) -> None:
        """Nothing to release; present for the protocol."""
