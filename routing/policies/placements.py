"""Requests in flight that a scorer placed, by replica: what it must remember until they finish.

``fleet-cost`` keeps two such sets: the overflow requests on each replica (they cannot make
their SLOs there, so they are not charged for), and the short decodes (their ``max_tokens``, so
that a prefill is charged for pushing them past their TPOT). Both move with a retry, leave when
the request completes, and are bounded: a request whose completion never comes is forgotten,
oldest first, once more than ``limit`` are remembered.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from routing.types import ReplicaId

__all__ = ["Placements"]

V = TypeVar("V")


class Placements(Generic[V]):
    """Request id -> (replica, value), with each replica's values; at most ``limit`` requests."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._at: OrderedDict[str, tuple[ReplicaId, V]] = OrderedDict()
        self._on: dict[ReplicaId, list[V]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def place(self, request_id: str, replica: ReplicaId, value: V) -> None:
        """``request_id`` now runs on ``replica`` (moved there, if it ran elsewhere)."""
        self.forget(request_id)
        self._at[request_id] = (replica, value)
        self._on.setdefault(replica, []).append(value)
        while len(self._at) > self.limit:
            self.forget(next(iter(self._at)))

    def where(self, request_id: str) -> ReplicaId | None:
        """The replica ``request_id`` runs on, if placed."""
        where = self._at.get(request_id)
        return where[0] if where is not None else None

    def forget(self, request_id: str) -> None:
        """``request_id`` finished (or was never placed: nothing happens)."""
        where = self._at.pop(request_id, None)
        if where is not None:
            self._on[where[0]].remove(where[1])

    def on(self, replica: ReplicaId) -> list[V]:
        """The values of the requests in flight on ``replica`` (do not modify)."""
        return self._on.get(replica, [])

    def count(self, replica: ReplicaId) -> int:
        """How many requests are in flight on ``replica``."""
        return len(self._on.get(replica, ()))
