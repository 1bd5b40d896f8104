"""Pre-warm traffic counted across every gateway of the fleet, through the placement store.

Each gateway used to plan pre-warming from the requests it saw itself. Behind a load balancer
that spreads tenants unevenly (or one gateway per application), each saw the adapters the others
served as idle, and its plan evicted them to make room for its own hot ones; the others' plans put
them back (docs/benchmarks/adapters-two-gateways.md). So each pre-warm round a gateway writes its
own window to the store (per bucket of the same wall-clock width on every gateway, under its own
id) and plans from its own counts plus the others' as last read.

Each gateway writes absolute counts, not increments: a write that timed out after Redis applied
it is simply written again, never counted twice. Until a round has read the others' counts, or
while the store cannot answer, the plan uses this gateway's counts alone, as before: a Redis
outage degrades pre-warming, never routing.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection

from adapters_registry.placement import PlacementStore, PlacementUnavailable
from adapters_registry.prewarm import PrewarmSettings, TrafficWindow

log = logging.getLogger(__name__)

__all__ = ["SharedTraffic"]


class SharedTraffic:
    """This gateway's traffic window, and the other gateways' as of the last ``sync``."""

    def __init__(self, gateway_id: str, settings: PrewarmSettings | None = None) -> None:
        self.gateway_id = gateway_id
        self.own = TrafficWindow(settings)
        #: The other gateways' counts per (bucket, adapter) as the last ``sync`` read them, or
        #: None (never read, or the store could not answer).
        self._others: dict[tuple[int, str], int] | None = None
        #: Counts this gateway published for adapters it no longer has, to be written as 0.
        self._retracted: set[tuple[int, str]] = set()

    def record(self, adapter: str, now: float) -> None:
        """Count one request for ``adapter`` at ``now`` (wall clock)."""
        self.own.record(adapter, now)

    def counts(self, now: float) -> dict[str, int]:
        """Requests per adapter within the window ending at ``now``: this gateway's, plus the
        others' as last read (alone until they could be read)."""
        total = Counter(self.own.counts(now))
        if self._others is not None:
            oldest = self.own.oldest_slot(now)
            for (slot, adapter), n in self._others.items():
                if slot >= oldest:
                    total[adapter] += n
        return dict(total)

    def forget(self, names: Collection[str]) -> None:
        """Stop counting ``names`` (a reload removed them), and retract what this gateway
        published for them: a gateway still on the old policy would otherwise go on pre-warming
        a removed adapter from this one's counts (the LoRA-reload review)."""
        self._retracted.update(self.own.forget(names))
        if self._others is not None:
            self._others = {k: n for k, n in self._others.items() if k[1] not in names}

    async def sync(self, store: PlacementStore, now: float) -> None:
        """Write this gateway's window to the store and read the other gateways' back."""
        oldest = self.own.oldest_slot(now)
        self._retracted = {key for key in self._retracted if key[0] >= oldest}
        counts = {**dict.fromkeys(self._retracted, 0), **self.own.buckets(now)}
        try:
            await store.put_traffic(self.gateway_id, counts, self.own.settings.window_s)
            self._retracted.clear()
            self._others = await store.traffic(self.own.oldest_slot(now), self.gateway_id)
        except PlacementUnavailable as exc:
            log.warning("pre-warm plans from this gateway's own traffic: %s", exc)
            self._others = None
