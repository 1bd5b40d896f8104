"""Where adapters sit: per replica, the resident adapters, their last use and requests in flight.

The model follows vLLM. An adapter loaded through ``/v1/load_lora_adapter`` is *resident*: the
engine keeps it in its host-memory cache (``--max-cpu-loras``) and moves the most recently used
ones into its GPU LoRA slots (``--max-loras``) per batch. So the registry keeps at most
``max_cpu_loras`` adapters resident per replica (``max_loras`` when the host size is unknown) and
treats the ``max_loras`` most recently used of them as the GPU tier; the rest are host-cached.

Backends (``PlacementStore``) hold this state where every gateway can see it: in memory for one
gateway (``placement_memory``), in Redis for many (``placement_redis``). The pure functions here
(eviction order, tiering, merging the engine's report) are shared by both and unit-tested alone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from routing.state import ReplicaState
from routing.types import ReplicaId

Tier = Literal["gpu", "host"]


def holds_weights(resident: bool, recorded: str | None, wanted: str) -> bool:
    """A copy serves the weights at ``wanted`` if resident with them recorded, or with none
    recorded (first seen in an engine report: taken as the catalog's until a reload changes
    the source, which marks such copies as unknown weights, ``loader.UNKNOWN_WEIGHTS``)."""
    return resident and (recorded is None or recorded == wanted)


@dataclass(frozen=True)
class Residency:
    """One adapter on one replica as the registry last knew it."""

    resident: bool
    #: Wall-clock time of the last load, unload or first sighting in an engine report.
    changed_at: float
    #: Wall-clock time a request last used it there (0: never through this fleet of gateways).
    last_used: float = 0.0
    #: The ``source`` a gateway loaded it from (None: first seen in an engine report). vLLM
    #: loads by name, so after a reload re-sources an adapter a replica may still hold the old
    #: weights under the name: ``serves_weights`` tells them apart.
    source: str | None = None

    def serves_weights(self, source: str) -> bool:
        """True if resident with the weights at ``source`` (see ``holds_weights``)."""
        return holds_weights(self.resident, self.source, source)


@dataclass(frozen=True)
class AdapterStatus:
    """The fast per-request answer: resident, and whether a load/unload is under way."""

    resident: bool
    busy: bool
    #: The ``source`` it was loaded from, when a gateway recorded it (see ``Residency.source``).
    source: str | None = None

    def serves_weights(self, source: str) -> bool:
        """True if resident with the weights at ``source`` (see ``holds_weights``)."""
        return holds_weights(self.resident, self.source, source)


@dataclass(frozen=True)
class ReplicaPlacement:
    """A replica's adapters at one moment (a read of the store)."""

    replica: ReplicaId
    entries: Mapping[str, Residency] = field(default_factory=dict)
    #: Requests in flight per adapter (all gateways, when the store is shared).
    inflight: Mapping[str, int] = field(default_factory=dict)
    #: Wall-clock times of recent loads on this replica (for the thrash guard).
    recent_loads: tuple[float, ...] = ()

    @property
    def resident(self) -> frozenset[str]:
        """Adapters loaded on the replica."""
        return frozenset(name for name, e in self.entries.items() if e.resident)

    def by_recency(self) -> list[str]:
        """Resident adapters, most recently used first (ties by name, for determinism)."""
        live = [(name, e) for name, e in self.entries.items() if e.resident]
        live.sort(key=lambda item: (-item[1].last_used, item[0]))
        return [name for name, _ in live]

    def tier(self, adapter: str, max_loras: int | None) -> Tier | None:
        """``gpu``, ``host`` or None (not resident), modelling the engine's LRU slot use."""
        entry = self.entries.get(adapter)
        if entry is None or not entry.resident:
            return None
        if max_loras is None:
            return "gpu"
        return "gpu" if adapter in self.by_recency()[:max_loras] else "host"


@dataclass(frozen=True)
class SlotCapacity:
    """GPU slots and host-cache size of a replica (vLLM ``--max-loras`` / ``--max-cpu-loras``)."""

    gpu: int | None
    host: int | None

    @property
    def resident_limit(self) -> int | None:
        """How many adapters may be resident at once; None if unknown (no limit enforced)."""
        return self.host if self.host is not None else self.gpu


def capacity_of(
    state: ReplicaState, pool_max_loras: int | None = None, pool_max_cpu_loras: int | None = None
) -> SlotCapacity:
    """Slot counts: the engine's report (``ReplicaState``) wins over the pool's configuration."""
    gpu = state.max_loras if state.max_loras is not None else pool_max_loras
    host = state.max_cpu_loras if state.max_cpu_loras is not None else pool_max_cpu_loras
    return SlotCapacity(gpu=gpu, host=host)


def eviction_candidates(
    placement: ReplicaPlacement, pinned: Collection[str], keep: Collection[str] = ()
) -> list[str]:
    """Resident adapters that may be unloaded, least recently used first.

    Never a pinned adapter, one with requests in flight, or one in ``keep`` (the adapter being
    loaded, or one the pre-warm plan wants there).
    """
    order = placement.by_recency()
    order.reverse()
    return [
        name
        for name in order
        if name not in pinned and name not in keep and placement.inflight.get(name, 0) <= 0
    ]


def needs_room(placement: ReplicaPlacement, capacity: SlotCapacity) -> int:
    """How many adapters must go before one more can be resident (0 if there is room)."""
    limit = capacity.resident_limit
    if limit is None:
        return 0
    return max(0, len(placement.resident) - limit + 1)


def merge_engine_report(
    entries: Mapping[str, Residency],
    engine_resident: Collection[str],
    read_at: float,
    grace_s: float,
) -> dict[str, Residency]:
    """Combine the engine's view (``ReplicaState``) with what the gateways did themselves.

    The engine is the truth, but its report was read at ``read_at``: a load or unload made by a
    gateway after ``read_at - grace_s`` may not show in it yet, so such entries are kept as the
    gateway recorded them. Everything older follows the engine: adapters it lists are resident
    (keeping their last-use time), others are forgotten (tombstones included).
    """
    cutoff = read_at - grace_s
    merged: dict[str, Residency] = {}
    for name in set(entries) | set(engine_resident):
        local = entries.get(name)
        if local is not None and local.changed_at >= cutoff:
            merged[name] = local
        elif name in engine_resident:
            if local is not None and local.resident:
                merged[name] = local
            else:
                last_used = local.last_used if local is not None else 0.0
                merged[name] = Residency(True, changed_at=read_at, last_used=last_used)
    return merged


@runtime_checkable
class PlacementStore(Protocol):
    """Shared placement state; every method may raise ``PlacementUnavailable``."""

    backend: str

    async def status(self, replica: ReplicaId, adapter: str) -> AdapterStatus:
        """Resident, and whether a load or unload of it is in progress (locked)."""
        ...

    async def snapshot(self, replica: ReplicaId, loads_since: float) -> ReplicaPlacement:
        """Entries, in-flight counts and load times since ``loads_since`` of one replica."""
        ...

    async def mark_resident(
        self, replica: ReplicaId, adapter: str, now: float, source: str | None = None
    ) -> None:
        """Record a completed load of the weights at ``source``."""
        ...

    async def mark_unloaded(self, replica: ReplicaId, adapter: str, now: float) -> None:
        """Record a completed unload (a tombstone, until the engine's report agrees)."""
        ...

    async def record_source_if_unknown(
        self, replica: ReplicaId, adapter: str, source: str
    ) -> bool:
        """Record ``source`` for a resident copy with none recorded, in one step (its times and
        eviction order unchanged); False if it is not resident or has a source already."""
        ...

    async def touch(self, replica: ReplicaId, adapter: str, now: float) -> None:
        """Record a use of a resident adapter (moves it to the back of the eviction order)."""
        ...

    async def sync_from_engine(
        self, replica: ReplicaId, engine_resident: Collection[str], read_at: float, grace_s: float
    ) -> None:
        """Apply an engine report atomically (see ``merge_engine_report``)."""
        ...

    async def begin_use(self, replica: ReplicaId, adapter: str, lease: str, ttl_s: float) -> None:
        """Count a request in flight; the lease expires after ``ttl_s`` if never ended."""
        ...

    async def end_use(self, replica: ReplicaId, adapter: str, lease: str) -> None:
        """The request ended."""
        ...

    async def leases(self, replica: ReplicaId, adapter: str) -> list[str]:
        """The leases of the requests in flight on (replica, adapter), from every gateway."""
        ...

    async def try_lock(self, replica: ReplicaId, adapter: str, owner: str, ttl_s: float) -> bool:
        """Take the (replica, adapter) operation lock if free; it expires after ``ttl_s``."""
        ...

    async def unlock(self, replica: ReplicaId, adapter: str, owner: str) -> None:
        """Release the lock if ``owner`` still holds it."""
        ...

    async def record_load(self, replica: ReplicaId, at: float, keep_s: float) -> None:
        """Log a load at ``at``; entries older than ``keep_s`` may be dropped."""
        ...

    async def forget_replica(self, replica: ReplicaId) -> None:
        """Drop everything about a replica that left the fleet."""
        ...

    async def put_traffic(
        self, gateway: str, counts: Mapping[tuple[int, str], int], window_s: float
    ) -> None:
        """Set ``gateway``'s requests per (wall-clock bucket, adapter) in the fleet's pre-warm
        traffic window (``shared_traffic.py``), ``window_s`` long: absolute counts, so writing
        them again changes nothing."""
        ...

    async def traffic(self, oldest_slot: int, besides: str) -> dict[tuple[int, str], int]:
        """Every gateway's but ``besides``'s requests per (bucket, adapter), summed, from
        ``oldest_slot`` on (older ones may be dropped)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class PlacementUnavailable(RuntimeError):
    """The placement store could not answer (Redis down, timeout)."""
