"""Pre-warming and replication: put hot adapters on more replicas before requests wait for them.

``plan_replication`` is pure: from per-adapter request counts over a sliding window, the catalog's
``prewarm_replicas`` and each replica's slots and residents, it decides how many replicas each
adapter should be on and which loads (and, to make room, which unloads) get there. ``reconcile``
carries a plan out through the loader. Keeping the two apart lets the planner be tested
table-driven and lets ``fleetgate`` show a plan without acting on it.

Desired replicas per adapter:

- an adapter with traffic gets ``round(share of requests × slot budget)``, at least 1 and at most
  every replica; the slot budget is ``fill_fraction`` of all resident slots (each replica's
  ``max_cpu_loras``, else ``max_loras``), leaving room for on-demand loads of the long tail;
- ``prewarm_replicas`` from the catalog is a floor (pinned adapters are kept there for good);
- when the total exceeds the budget, the most replicated adapters give up replicas first, never
  below their floor or below 1 while they have traffic.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from adapters_registry.errors import AdapterError
from adapters_registry.loader import AdapterLoader
from routing.state import ReplicaState
from routing.types import ReplicaId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrewarmSettings:
    """Knobs of the planner and its traffic window."""

    #: Length of the sliding window that measures traffic per adapter.
    window_s: float = 300.0
    #: Buckets of the window (its time resolution).
    buckets: int = 30
    #: Share of all resident slots the plan may fill (the rest serve on-demand loads).
    fill_fraction: float = 0.75
    #: Requests in the window below which an adapter gets no replica from traffic alone.
    min_requests: int = 1

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.buckets < 1:
            raise ValueError(
                f"window_s ({self.window_s}) must be > 0 and buckets ({self.buckets}) >= 1"
            )
        if not 0 < self.fill_fraction <= 1:
            raise ValueError(f"fill_fraction: must be in (0, 1] (got {self.fill_fraction})")
        if self.min_requests < 1:
            raise ValueError(f"min_requests: must be >= 1 (got {self.min_requests})")


class TrafficWindow:
    """Requests per adapter over the last ``window_s`` seconds, in fixed buckets."""

    def __init__(self, settings: PrewarmSettings | None = None) -> None:
        self.settings = settings or PrewarmSettings()
        self._width = self.settings.window_s / self.settings.buckets
        self._buckets: dict[int, Counter[str]] = {}

    def slot(self, now: float | None = None) -> int:
        """The bucket ``now`` (wall clock) falls in: the same on every gateway of a fleet."""
        return int((time.time() if now is None else now) // self._width)

    def oldest_slot(self, now: float | None = None) -> int:
        """The oldest bucket still inside the window ending at ``now``."""
        return self.slot(now) - self.settings.buckets + 1

    def record(self, adapter: str, now: float | None = None, n: int = 1) -> None:
        """Count ``n`` requests for ``adapter`` at ``now`` (wall clock)."""
        slot = self.slot(now)
        self._buckets.setdefault(slot, Counter())[adapter] += n
        self._expire(slot)

    def counts(self, now: float | None = None) -> dict[str, int]:
        """Requests per adapter within the window ending at ``now``."""
        slot = self.slot(now)
        self._expire(slot)
        total: Counter[str] = Counter()
        for bucket in self._buckets.values():
            total.update(bucket)
        return dict(total)

    def buckets(self, now: float | None = None) -> dict[tuple[int, str], int]:
        """Requests per (bucket, adapter) within the window ending at ``now``."""
        self._expire(self.slot(now))
        return {
            (slot, adapter): n
            for slot, bucket in self._buckets.items()
            for adapter, n in bucket.items()
        }

    def forget(self, names: Collection[str]) -> list[tuple[int, str]]:
        """Drop the counts of ``names`` (adapters no longer in the catalog); returns the
        (bucket, adapter) pairs that had one."""
        dropped = []
        for slot, bucket in self._buckets.items():
            for name in names:
                if bucket.pop(name, None) is not None:
                    dropped.append((slot, name))
        return dropped

    def _expire(self, current: int) -> None:
        oldest = current - self.settings.buckets + 1
        for slot in [s for s in self._buckets if s < oldest]:
            del self._buckets[slot]


@dataclass(frozen=True)
class AdapterDemand:
    """One catalogued adapter as the planner sees it."""

    name: str
    requests: int = 0
    pinned: bool = False
    prewarm_replicas: int = 0


@dataclass(frozen=True)
class ReplicaSlots:
    """One replica as the planner sees it."""

    replica: ReplicaId
    #: Adapters it may hold at once (None: unknown, treated as unlimited).
    capacity: int | None
    resident: frozenset[str] = frozenset()
    #: Resident adapters that must stay (requests in flight).
    busy: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PlanStep:
    """Load ``adapter`` on ``replica``, unloading ``evict`` first when set."""

    replica: ReplicaId
    adapter: str
    evict: str | None = None


@dataclass(frozen=True)
class ReplicationPlan:
    """Desired replicas per adapter, and the steps that move the fleet towards them."""

    desired: dict[str, int]
    steps: list[PlanStep] = field(default_factory=list)


def desired_replicas(
    demands: Sequence[AdapterDemand],
    n_replicas: int,
    total_slots: int | None,
    settings: PrewarmSettings | None = None,
) -> dict[str, int]:
    """How many replicas each adapter should be resident on."""
    s = settings or PrewarmSettings()
    if n_replicas <= 0:
        return {d.name: 0 for d in demands}
    hot = [d for d in demands if d.requests >= s.min_requests]
    total = sum(d.requests for d in hot)
    budget = (
        n_replicas * max(1, len(demands))
        if total_slots is None
        else math.floor(total_slots * s.fill_fraction)
    )
    floor: dict[str, int] = {}
    desired: dict[str, int] = {}
    for d in demands:
        floor[d.name] = min(n_replicas, d.prewarm_replicas)
        from_traffic = 0
        if d.requests >= s.min_requests and total > 0:
            from_traffic = max(1, min(n_replicas, round(d.requests / total * budget)))
            floor[d.name] = max(floor[d.name], 1)
        desired[d.name] = max(floor[d.name], from_traffic)
    requests = {d.name: d.requests for d in demands}
    while sum(desired.values()) > budget:
        trimmable = [name for name in desired if desired[name] > floor[name]]
        if not trimmable:
            break  # floors alone exceed the budget; placement will fit what it can
        # Most replicated first; among equals the least requested, then by name.
        victim = min(trimmable, key=lambda n: (-desired[n], requests[n], n))
        desired[victim] -= 1
    return desired


def place(
    desired: Mapping[str, int],
    demands: Sequence[AdapterDemand],
    replicas: Sequence[ReplicaSlots],
) -> list[PlanStep]:
    """Loads (with the unloads that make room) that bring each adapter to its desired count.

    Hot adapters are placed first. A load goes to a replica with a free slot when there is one
    (emptiest first), else replaces an adapter that is over its own desired count, not pinned
    and not busy (least requested first). Adapters above their count are not unloaded for their
    own sake: an extra resident copy costs nothing until its slot is needed.
    """
    info = {d.name: d for d in demands}
    resident = {r.replica: set(r.resident) for r in replicas}
    holders: Counter[str] = Counter(a for r in replicas for a in r.resident)
    by_id = {r.replica: r for r in replicas}
    steps: list[PlanStep] = []
    order = sorted(desired, key=lambda n: (-info[n].requests if n in info else 0, n))
    for adapter in order:
        need = desired[adapter] - holders[adapter]
        if need <= 0:
            continue
        candidates = sorted(
            (r for r in replicas if adapter not in resident[r.replica]),
            key=lambda r: (not _has_room(r, resident[r.replica]), len(resident[r.replica]),
                           r.replica),
        )
        for replica in candidates:
            if need == 0:
                break
            here = resident[replica.replica]
            evict = None
            if not _has_room(by_id[replica.replica], here):
                evict = _victim(here, replica.busy, desired, holders, info, keep=adapter)
                if evict is None:
                    continue
                here.discard(evict)
                holders[evict] -= 1
            here.add(adapter)
            holders[adapter] += 1
            steps.append(PlanStep(replica.replica, adapter, evict))
            need -= 1
    return steps


def _has_room(replica: ReplicaSlots, resident: set[str]) -> bool:
    return replica.capacity is None or len(resident) < replica.capacity


def _victim(
    resident: Iterable[str],
    busy: frozenset[str],
    desired: Mapping[str, int],
    holders: Mapping[str, int],
    info: Mapping[str, AdapterDemand],
    keep: str,
) -> str | None:
    # Only adapters of this plan's catalogue: another base model's (a replica serving two) and
    # another gateway's runtime additions are not this plan's to judge.
    choices = [
        name for name in resident
        if name != keep
        and name in info
        and name not in busy
        and not info[name].pinned
        and holders[name] > desired.get(name, 0)
    ]
    if not choices:
        return None
    return min(choices, key=lambda n: (info[n].requests if n in info else 0, n))


def plan_replication(
    demands: Sequence[AdapterDemand],
    replicas: Sequence[ReplicaSlots],
    settings: PrewarmSettings | None = None,
) -> ReplicationPlan:
    """Desired counts and the steps to reach them (pure; see the module docstring)."""
    capacities = [r.capacity for r in replicas]
    total_slots = None if any(c is None for c in capacities) else sum(c or 0 for c in capacities)
    desired = desired_replicas(demands, len(replicas), total_slots, settings)
    return ReplicationPlan(desired, place(desired, demands, replicas))


@dataclass
class ReconcileReport:
    """What ``reconcile`` did."""

    loaded: list[PlanStep] = field(default_factory=list)
    failed: list[tuple[PlanStep, str]] = field(default_factory=list)


async def reconcile(
    plan: ReplicationPlan, loader: AdapterLoader, states: Mapping[ReplicaId, ReplicaState]
) -> ReconcileReport:
    """Carry out ``plan`` step by step; a failed step is reported, never raised."""
    report = ReconcileReport()
    for step in plan.steps:
        state = states.get(step.replica)
        if state is None or not state.healthy:
            report.failed.append((step, "replica unknown or unhealthy"))
            continue
        if step.evict is not None and loader.loads_failing(step.replica, step.adapter):
            # Loads there started failing since the plan was made: the load would not even be
            # tried, so evicting for it would only lose an adapter that works.
            report.failed.append((step, "adapter loads on this replica have been failing"))
            continue
        try:
            if step.evict is not None:
                # Never from under a request: one may have started since the plan was made.
                await loader.unload(state, step.evict, reason="prewarm", if_idle=True)
            await loader.ensure_loaded(state, step.adapter)
            report.loaded.append(step)
        except AdapterError as exc:
            log.info("pre-warm step %s failed: %s", step, exc)
            report.failed.append((step, str(exc)))
    return report
