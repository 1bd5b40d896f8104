"""In-process placement store, for a single gateway (``fleetgate up``) and for tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from adapters_registry.placement import (
    AdapterStatus,
    ReplicaPlacement,
    Residency,
    merge_engine_report,
)
from routing.types import ReplicaId


class MemoryPlacementStore:
    """``PlacementStore`` in dictionaries. ``clock`` (seconds) drives lock and lease expiry."""

    backend = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[ReplicaId, dict[str, Residency]] = {}
        # (replica, adapter) -> lease -> expiry on ``clock``
        self._leases: dict[tuple[ReplicaId, str], dict[str, float]] = {}
        # (replica, adapter) -> (owner, expiry on ``clock``)
        self._locks: dict[tuple[ReplicaId, str], tuple[str, float]] = {}
        self._loads: dict[ReplicaId, list[float]] = {}
        # (wall-clock bucket, gateway, adapter) -> requests: the pre-warm traffic window
        self._traffic: dict[tuple[int, str, str], int] = {}

    def _locked(self, key: tuple[ReplicaId, str]) -> bool:
        held = self._locks.get(key)
        if held is None:
            return False
        if held[1] <= self._clock():
            del self._locks[key]
            return False
        return True

    def _inflight(self, key: tuple[ReplicaId, str]) -> int:
        leases = self._leases.get(key)
        if not leases:
            return 0
        now = self._clock()
        for lease in [lease for lease, expiry in leases.items() if expiry <= now]:
            del leases[lease]
        return len(leases)

    async def status(self, replica: ReplicaId, adapter: str) -> AdapterStatus:
        entry = self._entries.get(replica, {}).get(adapter)
        return AdapterStatus(
            resident=entry is not None and entry.resident,
            busy=self._locked((replica, adapter)),
            source=entry.source if entry is not None else None,
        )

    async def snapshot(self, replica: ReplicaId, loads_since: float) -> ReplicaPlacement:
        entries = dict(self._entries.get(replica, {}))
        inflight = {name: n for name in entries if (n := self._inflight((replica, name))) > 0}
        loads = tuple(t for t in self._loads.get(replica, []) if t >= loads_since)
        return ReplicaPlacement(replica, entries, inflight, loads)

    async def mark_resident(
        self, replica: ReplicaId, adapter: str, now: float, source: str | None = None
    ) -> None:
        # A fresh load counts as a use: it must not be the first thing the next load evicts.
        self._entries.setdefault(replica, {})[adapter] = Residency(True, now, now, source)

    async def mark_unloaded(self, replica: ReplicaId, adapter: str, now: float) -> None:
        old = self._entries.setdefault(replica, {}).get(adapter)
        last_used = 0.0 if old is None else old.last_used
        self._entries[replica][adapter] = Residency(False, now, last_used)

    async def record_source_if_unknown(
        self, replica: ReplicaId, adapter: str, source: str
    ) -> bool:
        entries = self._entries.get(replica, {})
        old = entries.get(adapter)
        if old is None or not old.resident or old.source is not None:
            return False
        entries[adapter] = replace(old, source=source)
        return True

    async def touch(self, replica: ReplicaId, adapter: str, now: float) -> None:
        entries = self._entries.get(replica, {})
        old = entries.get(adapter)
        if old is not None:
            entries[adapter] = replace(old, last_used=now)

    async def sync_from_engine(
        self, replica: ReplicaId, engine_resident: Collection[str], read_at: float, grace_s: float
    ) -> None:
        self._entries[replica] = merge_engine_report(
            self._entries.get(replica, {}), engine_resident, read_at, grace_s
        )

    async def begin_use(self, replica: ReplicaId, adapter: str, lease: str, ttl_s: float) -> None:
        self._leases.setdefault((replica, adapter), {})[lease] = self._clock() + ttl_s

    async def end_use(self, replica: ReplicaId, adapter: str, lease: str) -> None:
        self._leases.get((replica, adapter), {}).pop(lease, None)

    async def leases(self, replica: ReplicaId, adapter: str) -> list[str]:
        self._inflight((replica, adapter))  # drops the expired ones
        return sorted(self._leases.get((replica, adapter), {}))

    async def try_lock(self, replica: ReplicaId, adapter: str, owner: str, ttl_s: float) -> bool:
        key = (replica, adapter)
        if self._locked(key):
            return False
        self._locks[key] = (owner, self._clock() + ttl_s)
        return True

    async def unlock(self, replica: ReplicaId, adapter: str, owner: str) -> None:
        key = (replica, adapter)
        held = self._locks.get(key)
        if held is not None and held[0] == owner:
            del self._locks[key]

    async def record_load(self, replica: ReplicaId, at: float, keep_s: float) -> None:
        loads = [t for t in self._loads.get(replica, []) if t >= at - keep_s]
        loads.append(at)
        self._loads[replica] = loads

    async def forget_replica(self, replica: ReplicaId) -> None:
        self._entries.pop(replica, None)
        self._loads.pop(replica, None)
        for table in (self._leases, self._locks):
            for key in [k for k in table if k[0] == replica]:
                del table[key]

    async def put_traffic(
        self, gateway: str, counts: Mapping[tuple[int, str], int], window_s: float
    ) -> None:
        for (slot, adapter), n in counts.items():
            self._traffic[(slot, gateway, adapter)] = n

    async def traffic(self, oldest_slot: int, besides: str) -> dict[tuple[int, str], int]:
        for key in [key for key in self._traffic if key[0] < oldest_slot]:
            del self._traffic[key]
        summed: dict[tuple[int, str], int] = {}
        for (slot, gateway, adapter), n in self._traffic.items():
            if gateway != besides:
                summed[(slot, adapter)] = summed.get((slot, adapter), 0) + n
        return summed

    async def close(self) -> None:
        return None
