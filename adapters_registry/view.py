"""This gateway's latest read of every replica's placement, for synchronous routing look-ups.

Routing runs per request over every candidate replica and must not wait on Redis each time, so
it reads this view; the registry refreshes it from the store periodically and after every load or
unload this gateway makes.
"""

from __future__ import annotations

from adapters_registry.placement import ReplicaPlacement
from routing.types import ReplicaId


class PlacementView:
    """Replica id -> the last ``ReplicaPlacement`` read from the store."""

    def __init__(self) -> None:
        self._by_replica: dict[ReplicaId, ReplicaPlacement] = {}

    def get(self, replica: ReplicaId) -> ReplicaPlacement | None:
        """The last read of ``replica``, or None if never read."""
        return self._by_replica.get(replica)

    def update(self, placement: ReplicaPlacement) -> None:
        """Replace the read of one replica."""
        self._by_replica[placement.replica] = placement

    def forget(self, replica: ReplicaId) -> None:
        """Drop a replica that left the fleet."""
        self._by_replica.pop(replica, None)

    def replicas(self) -> list[ReplicaId]:
        """Replicas with a read."""
        return list(self._by_replica)
