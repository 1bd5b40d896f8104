"""The replicas a decision sees, with the figures that a large fleet's pruning reads as arrays.

A decision over 1,000 replicas cannot afford to read each replica's queue figures from its
``ReplicaState`` (an attribute read costs ~60 ns in Python; six per replica is most of a
millisecond). A ``Fleet`` is a sequence of ``ReplicaState`` that keeps those figures in numpy
arrays, written when a state is replaced (``put``) instead of read at every decision. Its owner
(the gateway's replica registry) replaces states, it never changes one in place: a state changed
in place would leave the arrays stale. Any other sequence of states works too (the engine reads
the objects then, as ``routing/prune.py`` explains).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import overload

import numpy as np

from routing.state import MAX_REQUEST_COUNT, ReplicaState
from routing.types import ReplicaId

__all__ = ["Fleet", "adapter_residence"]

_ID = attrgetter("replica_id")
_RUNNING = attrgetter("running")
_WAITING = attrgetter("waiting")
_INFLIGHT = attrgetter("inflight_requests")
_QUEUED = attrgetter("queued")


def _count(value: int) -> int:
    """A request count as the fleet's 64-bit arrays hold it: one past any engine's
    (``MAX_REQUEST_COUNT``, a glitch that got past the parsers) is held at that bound. Taken in
    as read, one such figure raised ``OverflowError`` on every rebuild of the fleet, and every
    request failed (the routing review, session 46)."""
    return value if 0 <= value <= MAX_REQUEST_COUNT else min(max(value, 0), MAX_REQUEST_COUNT)


class Fleet(Sequence[ReplicaState]):
    """Replica states in a fixed order, their queue figures mirrored in arrays.

    Membership is fixed: ``put`` replaces the state of a replica already in the fleet; a new or
    removed replica needs a new ``Fleet``. Per-model serving masks and per-adapter residence are
    built on first need and dropped when a state changes what they read.
    """

    __slots__ = (
        "_adapters",
        "_inflight",
        "_position",
        "_queued",
        "_running",
        "_serving",
        "_states",
        "_waiting",
    )

    def __init__(self, states: Iterable[ReplicaState]) -> None:
        self._states = list(states)
        n = len(self._states)
        self._running = np.fromiter(map(_count, map(_RUNNING, self._states)), np.int64, n)
        self._waiting = np.fromiter(map(_count, map(_WAITING, self._states)), np.int64, n)
        self._inflight = np.fromiter(map(_count, map(_INFLIGHT, self._states)), np.int64, n)
        self._queued = np.fromiter(map(_count, map(_QUEUED, self._states)), np.int64, n)
        self._position = {rid: i for i, rid in enumerate(map(_ID, self._states))}
        if len(self._position) != n:
            raise ValueError("a fleet lists each replica once")
        #: model -> healthy and serving it, per position.
        self._serving: dict[str, np.ndarray] = {}
        #: adapter -> 2 on the GPU, 1 in host memory, 0 absent, per position.
        self._adapters: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ sequence

    def __len__(self) -> int:
        return len(self._states)

    @overload
    def __getitem__(self, index: int) -> ReplicaState: ...
    @overload
    def __getitem__(self, index: slice) -> list[ReplicaState]: ...
    def __getitem__(self, index: int | slice) -> ReplicaState | list[ReplicaState]:
        return self._states[index]

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self._states)

    def __repr__(self) -> str:
        return f"Fleet({len(self._states)} replicas)"

    # ------------------------------------------------------------------ changes

    def put(self, state: ReplicaState) -> bool:
        """Replace the state of ``state.replica_id``; False (and no change) if it is not here."""
        position = self._position.get(state.replica_id)
        if position is None:
            return False
        old = self._states[position]
        self._states[position] = state
        self._running[position] = _count(state.running)
        self._waiting[position] = _count(state.waiting)
        self._inflight[position] = _count(state.inflight_requests)
        self._queued[position] = _count(state.queued)
        if old.healthy != state.healthy or old.models != state.models:
            self._serving.clear()
        if (
            old.loaded_adapters != state.loaded_adapters
            or old.cpu_cached_adapters != state.cpu_cached_adapters
        ):
            self._adapters.clear()
        return True

    def with_states(self, states: Sequence[ReplicaState]) -> Fleet:
        """A copy in which ``states`` replace those of the same replicas (which must be here)."""
        copy = Fleet.__new__(Fleet)
        copy._states = list(self._states)
        copy._running = self._running.copy()
        copy._waiting = self._waiting.copy()
        copy._inflight = self._inflight.copy()
        copy._queued = self._queued.copy()
        copy._position = self._position  # membership is the same: shared, never written
        copy._serving = dict(self._serving)
        copy._adapters = dict(self._adapters)
        for state in states:
            if not copy.put(state):
                raise KeyError(f"replica {state.replica_id!r} is not in this fleet")
        return copy

    # ------------------------------------------------------------------ columns

    @property
    def running(self) -> np.ndarray:
        """``ReplicaState.running`` per position (read-only view)."""
        return _read_only(self._running)

    @property
    def waiting(self) -> np.ndarray:
        return _read_only(self._waiting)

    @property
    def inflight(self) -> np.ndarray:
        return _read_only(self._inflight)

    @property
    def queued(self) -> np.ndarray:
        """``ReplicaState.queued`` per position (read-only view)."""
        return _read_only(self._queued)

    def position(self, replica: ReplicaId) -> int | None:
        """Where ``replica`` is in the fleet, or None."""
        return self._position.get(replica)

    def depths(self, matches: Mapping[ReplicaId, int]) -> np.ndarray:
        """Per position: the prefix depth ``matches`` gives its replica (0 if none)."""
        depth = np.zeros(len(self._states), np.int64)
        where = self._position.get
        for rid, blocks in matches.items():
            position = where(rid)
            if position is not None:
                depth[position] = blocks
        return depth

    def states(self, positions: Iterable[int]) -> list[ReplicaState]:
        """The states at ``positions``, in that order."""
        states = self._states
        return [states[i] for i in positions]

    def serving(self, model: str) -> np.ndarray:
        """Per position: healthy and serving ``model`` (the engine's built-in filter)."""
        mask = self._serving.get(model)
        if mask is None:
            mask = np.fromiter(
                (s.healthy and model in s.models for s in self._states), np.bool_, len(self)
            )
            mask.flags.writeable = False
            self._serving[model] = mask
        return mask

    def adapter_residence(self, adapter: str) -> np.ndarray:
        """Per position: 2 if ``adapter`` is in a GPU slot, 1 in host memory, 0 absent."""
        where = self._adapters.get(adapter)
        if where is None:
            where = adapter_residence(self._states, adapter)
            where.flags.writeable = False
            self._adapters[adapter] = where
        return where


def adapter_residence(states: Sequence[ReplicaState], adapter: str) -> np.ndarray:
    """Per state: 2 if ``adapter`` is in a GPU slot, 1 in host memory, 0 absent."""
    return np.fromiter(
        (
            2 if adapter in s.loaded_adapters else 1 if adapter in s.cpu_cached_adapters else 0
            for s in states
        ),
        np.int64,
        len(states),
    )


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view
