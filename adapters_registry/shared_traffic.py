"""Pre-warm traffic counted across every gateway of the fleet, through the placement store.

Each gateway used to plan pre-warming from the requests it saw itself. Behind a load balancer
that spreads tenants unevenly (or one gateway per application), each saw the adapters the others
served as idle, and its plan evicted them to make room for its own hot ones; the others' plans put
them back. The live adapter review measured 39 loads and 31 unloads in 100 s on a fleet with room
for every adapter. So each gateway adds its counts to the store's shared window (in buckets of
the same wall-clock width on every gateway) each pre-warm round and plans from the fleet's sum.

Until a round has read the shared window, or when the store cannot answer, the plan falls back to
this gateway's own counts, as before: a Redis outage degrades pre-warming, never routing.
"""

from __future__ import annotations

import logging
from collections import Counter

from adapters_registry.placement import PlacementStore, PlacementUnavailable
from adapters_registry.prewarm import PrewarmSettings, TrafficWindow

log = logging.getLogger(__name__)

__all__ = ["SharedTraffic"]


class SharedTraffic:
    """This gateway's traffic window, and the fleet's as of the last ``sync``."""

    def __init__(self, settings: PrewarmSettings | None = None) -> None:
        self.own = TrafficWindow(settings)
        #: Requests recorded since the last ``sync`` added them to the store: (bucket, adapter).
        self._unsent: Counter[tuple[int, str]] = Counter()
        #: The fleet's counts per (bucket, adapter) as the last ``sync`` read them, or None
        #: (never read, or the store could not answer).
        self._fleet: dict[tuple[int, str], int] | None = None

    def record(self, adapter: str, now: float) -> None:
        """Count one request for ``adapter`` at ``now`` (wall clock)."""
        self.own.record(adapter, now)
        self._unsent[(self.own.slot(now), adapter)] += 1

    def counts(self, now: float) -> dict[str, int]:
        """Requests per adapter within the window ending at ``now``: the fleet's as last read
        plus this gateway's since; this gateway's alone until the fleet's could be read."""
        if self._fleet is None:
            return self.own.counts(now)
        oldest = self.own.oldest_slot(now)
        total: Counter[str] = Counter()
        for table in (self._fleet, self._unsent):
            for (slot, adapter), n in table.items():
                if slot >= oldest:
                    total[adapter] += n
        return dict(total)

    async def sync(self, store: PlacementStore, now: float) -> None:
        """Add this gateway's new counts to the store's window and read the fleet's back."""
        oldest = self.own.oldest_slot(now)
        for key in [key for key in self._unsent if key[0] < oldest]:
            del self._unsent[key]  # out of the window while the store was away
        sent = Counter(self._unsent)
        try:
            if sent:
                await store.add_traffic(sent, self.own.settings.window_s)
            # Only what was sent is taken off: requests recorded meanwhile wait for the next.
            self._unsent.subtract(sent)
            self._unsent = +self._unsent
            self._fleet = await store.traffic(oldest)
        except PlacementUnavailable as exc:
            log.warning("pre-warm plans from this gateway's own traffic: %s", exc)
            self._fleet = None
