"""What serving an adapter on a replica will cost up front, for the ``expected-ttft`` policy.

``cold_load_ms`` is 0 for an adapter in a GPU slot, the host->device copy for one in the host
cache, and otherwise the measured load time: an EWMA of observed loads of that adapter on that
replica (falling back to the adapter on any replica, then to ``size_mb`` over a storage
bandwidth). When the replica's thrash guard is tripped, a non-resident adapter costs
``penalty_ms`` instead, steering traffic to replicas that already hold it or can load it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from adapters_registry.placement import ReplicaPlacement, merge_engine_report
from adapters_registry.thrash import ThrashGuard
from routing.types import ReplicaId


@dataclass(frozen=True)
class ColdStartSettings:
    """Defaults for load-time estimates before any load was measured."""

    #: Storage -> engine bandwidth for adapters not in the host cache (MB/s).
    storage_mb_per_s: float = 2000.0
    #: Host -> GPU copy bandwidth for host-cached adapters (MB/s).
    h2d_mb_per_s: float = 20000.0
    #: Fixed cost of a runtime load (HTTP round trip, engine bookkeeping), ms.
    load_overhead_ms: float = 50.0
    #: Size assumed for adapters whose catalog entry has no ``size_mb``.
    default_size_mb: float = 100.0
    #: Weight of the newest observation in the EWMA (0 < alpha <= 1).
    ewma_alpha: float = 0.3
    #: A load from storage is never estimated below this, measured or not. Besides its own wait
    #: it takes a GPU slot (and may evict an adapter another tenant is using): a duplicate load
    #: must not look like a near-tie with a replica that has the adapter resident, as a small
    #: adapter's few-ms load would (routing treats costs within ~10 ms as ties).
    min_load_ms: float = 200.0

    def __post_init__(self) -> None:
        for name in ("storage_mb_per_s", "h2d_mb_per_s", "default_size_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        for name in ("load_overhead_ms", "min_load_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha: must be in (0, 1] (got {self.ewma_alpha})")


class LoadTimeModel:
    """EWMA of observed load durations per (adapter, replica) and per adapter."""

    def __init__(self, settings: ColdStartSettings | None = None) -> None:
        self.settings = settings or ColdStartSettings()
        self._pair: dict[tuple[str, ReplicaId], float] = {}
        self._adapter: dict[str, float] = {}

    def observe(self, adapter: str, replica: ReplicaId, duration_ms: float) -> None:
        """Fold one measured load (ms) into both averages."""
        pair = (adapter, replica)
        self._pair[pair] = self._fold(self._pair.get(pair), duration_ms)
        self._adapter[adapter] = self._fold(self._adapter.get(adapter), duration_ms)

    def _fold(self, old: float | None, new: float) -> float:
        alpha = self.settings.ewma_alpha
        return new if old is None else alpha * new + (1 - alpha) * old

    def load_ms(self, adapter: str, replica: ReplicaId, size_mb: float | None) -> float:
        """Expected cost of loading ``adapter`` onto ``replica`` from storage (at least
        ``min_load_ms``): the measured time when there is one, else the size-based guess."""
        s = self.settings
        measured = self._pair.get((adapter, replica))
        if measured is None:
            measured = self._adapter.get(adapter)
        if measured is None:
            size = size_mb if size_mb is not None else s.default_size_mb
            measured = s.load_overhead_ms + size / s.storage_mb_per_s * 1000.0
        return max(measured, s.min_load_ms)

    def host_copy_ms(self, size_mb: float | None) -> float:
        """Time to move a host-cached adapter into a GPU slot."""
        s = self.settings
        size = size_mb if size_mb is not None else s.default_size_mb
        return size / s.h2d_mb_per_s * 1000.0


def residency_now(
    view: ReplicaPlacement | None,
    engine_resident: Collection[str],
    engine_read_at: float,
    grace_s: float,
    replica: ReplicaId,
) -> ReplicaPlacement:
    """The registry's view corrected by the engine's latest report (same rule as the store)."""
    entries = view.entries if view is not None else {}
    merged = merge_engine_report(entries, engine_resident, engine_read_at, grace_s)
    if view is None:
        return ReplicaPlacement(replica, merged)
    return ReplicaPlacement(replica, merged, view.inflight, view.recent_loads)


def cold_load_estimate_ms(
    adapter: str,
    size_mb: float | None,
    placement: ReplicaPlacement,
    max_loras: int | None,
    model: LoadTimeModel,
    guard: ThrashGuard,
    now: float,
) -> float:
    """Cost (ms) of serving ``adapter`` on ``placement``'s replica now."""
    tier = placement.tier(adapter, max_loras)
    if tier == "gpu":
        return 0.0
    if tier == "host":
        return model.host_copy_ms(size_mb)
    if guard.tripped(placement.recent_loads, now):
        return guard.settings.penalty_ms
    return model.load_ms(adapter, placement.replica, size_mb)

