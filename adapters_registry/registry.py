"""``AdapterRegistry``: the one object the gateway holds for everything about LoRA adapters.

It wires the catalog, the placement store and view, the loader, the cold-start model, the
thrash guard, the traffic window and the metrics, and offers the gateway a small API:

- request path: ``authorize`` → ``record_request`` → ``estimates_for`` (fills
  ``RoutingRequest.adapter_cold_load_ms``) → ``async with serving(replica, adapter)`` around the
  upstream call;
- ``/v1/models``: ``visible_to``;
- admin: ``add``, ``remove``;
- background (one ``cleanup_ctx`` task): ``run(get_states)`` refreshes placement from the
  engines' reports and pre-warms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from adapters_registry.catalog import AdapterCatalog
from adapters_registry.cold_start import (
    ColdStartSettings,
    LoadTimeModel,
    cold_load_estimate_ms,
    residency_now,
)
from adapters_registry.engine_api import LoraEngineApi
from adapters_registry.errors import AdapterError, AdapterUnloadFailed
from adapters_registry.load_failures import LoadFailures, LoadFailureSettings, party_of
from adapters_registry.loader import (
    IN_USE,
    UNKNOWN_WEIGHTS,
    AdapterLoader,
    LoaderSettings,
    LoadResult,
)
from adapters_registry.metrics import AdapterMetrics
from adapters_registry.paths import StorageRoots
from adapters_registry.placement import (
    PlacementStore,
    PlacementUnavailable,
    ReplicaPlacement,
    SlotCapacity,
    capacity_of,
)
from adapters_registry.placement_memory import MemoryPlacementStore
from adapters_registry.prewarm import (
    AdapterDemand,
    PlanStep,
    PrewarmSettings,
    ReconcileReport,
    ReplicaSlots,
    ReplicationPlan,
    plan_replication,
    reconcile,
)
from adapters_registry.shared_traffic import SharedTraffic
from adapters_registry.thrash import ThrashGuard, ThrashSettings
from adapters_registry.view import PlacementView
from routing.config import Adapter, Policy
from routing.contracts import RoutingRequest
from routing.outage_log import OutageLog
from routing.state import ReplicaState
from routing.types import ReplicaId

log = logging.getLogger(__name__)


#: How often a lasting placement-store outage is logged again (s).
STORE_DOWN_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class RegistrySettings:
    """Every knob of the registry, grouped by the part it tunes."""

    #: How long a gateway's own load/unload outranks an engine report read before it.
    sync_grace_s: float = 10.0
    loader: LoaderSettings = field(default_factory=LoaderSettings)
    cold_start: ColdStartSettings = field(default_factory=ColdStartSettings)
    thrash: ThrashSettings = field(default_factory=ThrashSettings)
    prewarm: PrewarmSettings = field(default_factory=PrewarmSettings)
    storage_roots: StorageRoots = field(default_factory=StorageRoots)
    load_failures: LoadFailureSettings = field(default_factory=LoadFailureSettings)

    def __post_init__(self) -> None:
        if self.sync_grace_s < 0:
            raise ValueError(f"sync_grace_s: must be >= 0 (got {self.sync_grace_s})")


class AdapterRegistry:
    """Catalog, placement, loading and pre-warming of LoRA adapters for one gateway."""

    def __init__(
        self,
        policy: Policy,
        store: PlacementStore,
        engine: LoraEngineApi,
        *,
        settings: RegistrySettings | None = None,
        metrics: AdapterMetrics | None = None,
        metrics_registry: CollectorRegistry | None = None,
        gateway_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``engine`` loads and unloads on the replicas: vLLM's runtime LoRA API in the gateway
        (``gateway.engine_api.EngineLoraClient``), a fake in unit tests."""
        self.settings = settings or RegistrySettings()
        self.catalog = AdapterCatalog(policy, self.settings.storage_roots)
        self.store = store
        self.view = PlacementView()
        self.metrics = metrics or AdapterMetrics(metrics_registry)
        # Private adapters are labelled opaquely on /metrics, which tenants can reach.
        self.metrics.label_of = self.catalog.metrics_label
        self.load_times = LoadTimeModel(self.settings.cold_start)
        self.guard = ThrashGuard(self.settings.thrash)
        #: Replicas whose loads fail, avoided for cold loads a while (``load_failures.py``).
        self.failures = LoadFailures(self.settings.load_failures, clock)
        #: Requests per adapter for pre-warming: this gateway's and, once read, the fleet's.
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.traffic = SharedTraffic(self.gateway_id, self.settings.prewarm)
        self._clock = clock
        #: While the placement store cannot answer (``refresh`` runs every poll: a Redis down
        #: logged a warning every 2 s, for good).
        self._store_outage = OutageLog(STORE_DOWN_LOG_INTERVAL_S)
        #: Background trims to a lowered resident limit, per replica (``refresh``).
        self._trims: dict[ReplicaId, asyncio.Task[int]] = {}
        self.loader = AdapterLoader(
            self.catalog,
            store,
            engine,
            self.view,
            self.capacity,
            metrics=self.metrics,
            load_times=self.load_times,
            guard=self.guard,
            failures=self.failures,
            settings=self.settings.loader,
            gateway_id=self.gateway_id,
            clock=clock,
        )

    @classmethod
    def in_memory(
        cls, policy: Policy, engine: LoraEngineApi, **kwargs: Any
    ) -> AdapterRegistry:
        """A registry for a single gateway (``fleetgate up``): placement in process memory."""
        return cls(policy, MemoryPlacementStore(), engine, **kwargs)

    # ------------------------------------------------------------------ policy

    def update_policy(self, policy: Policy) -> list[str]:
        """Follow a policy reload; returns the adapters whose weights the replicas must drop:
        runtime additions the reload dropped (see ``AdapterCatalog``), and adapters whose
        ``source`` it changed (``unload_everywhere`` them)."""
        before = {a.name: a.source for a in self.catalog}
        dropped = self.catalog.update_policy(policy)
        changed = [
            a.name for a in self.catalog if a.name in before and before[a.name] != a.source
        ]
        gone = [name for name in before if name not in self.catalog]
        self.traffic.forget(gone)
        self.loader.distrust_unrecorded(changed)
        return sorted({*dropped, *changed, *gone})

    def capacity(self, replica: ReplicaState) -> SlotCapacity:
        """Slots of ``replica``: the engine's report, else its pool's configuration."""
        pool = self.catalog.policy.pool(replica.pool)
        return capacity_of(
            replica,
            pool.max_loras if pool is not None else None,
            pool.max_cpu_loras if pool is not None else None,
        )

    # ------------------------------------------------------------------ request path

    def authorize(self, tenant: str, name: str) -> Adapter:
        """The adapter if ``tenant`` may use it; else ``AdapterNotFound`` (HTTP 404)."""
        return self.catalog.authorize(tenant, name)

    def visible_to(self, tenant: str) -> list[Adapter]:
        """Adapters ``/v1/models`` lists for ``tenant``."""
        return self.catalog.visible_to(tenant)

    def record_request(self, adapter: str) -> None:
        """Count one client request for an authorised adapter (metrics and pre-warm traffic).

        Call once per request, not per upstream attempt.
        """
        self.metrics.request(adapter)
        self.traffic.record(adapter, self._clock())

    def cold_load_ms(self, replica: ReplicaState, adapter: str) -> float:
        """Expected up-front cost (ms) of serving ``adapter`` on ``replica`` now.

        0 in a GPU slot, the host->GPU copy from the host cache, the measured (EWMA) load time
        otherwise, or the thrash guard's penalty when that replica has loaded too much lately.
        """
        entry = self.catalog.find(adapter)
        engine_resident = replica.loaded_adapters | replica.cpu_cached_adapters
        placement = residency_now(
            self.view.get(replica.replica_id),
            engine_resident,
            replica.metrics_read_at,
            self.settings.sync_grace_s,
            replica.replica_id,
        )
        held = placement.entries.get(adapter)
        if entry is not None and held is not None and not self.loader.serves(held, entry):
            # The weights a reload replaced: serving the new ones there is a load (after the
            # old ones are unloaded), never the resident copy.
            others = {name: e for name, e in placement.entries.items() if name != adapter}
            placement = ReplicaPlacement(
                placement.replica, others, placement.inflight, placement.recent_loads
            )
        size_mb = entry.size_mb if entry is not None else None
        gpu_slots = self.capacity(replica).gpu
        cost = cold_load_estimate_ms(
            adapter, size_mb, placement, gpu_slots, self.load_times, self.guard, self._clock(),
        )
        loading_for_s = (
            self.loader.loading_for_s(replica.replica_id, adapter, entry.source)
            if entry is not None else None
        )
        if loading_for_s is not None and cost > 0.0:
            # This gateway is loading it there already: a request sent there shares that load
            # and waits only for what is left of it. Costed as a full load, simultaneous first
            # requests each went to another replica and each loaded it (the LoRA-reload review).
            remaining = self.load_times.load_ms(adapter, replica.replica_id, size_mb)
            floor = self.load_times.settings.load_overhead_ms  # late, but not resident yet
            return max(floor, remaining - loading_for_s * 1000.0)
        only_host = adapter in replica.cpu_cached_adapters - replica.loaded_adapters
        if cost == 0.0 and only_host:
            # The engine says host cache, not a GPU slot: it pays the copy.
            return self.load_times.host_copy_ms(size_mb)
        if (
            placement.tier(adapter, gpu_slots) not in ("gpu", "host")
            and self.failures.avoided(replica.replica_id, party_of(entry))
        ):
            # Its loads have been failing: a load there is a timeout or an error, then a
            # fallback (a last resort still goes there).
            return max(cost, self.failures.settings.penalty_ms)
        return cost

    def estimates_for(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> dict[ReplicaId, float]:
        """``RoutingRequest.adapter_cold_load_ms`` for ``request`` ({} for a base model)."""
        if request.adapter is None:
            return {}
        return {r.replica_id: self.cold_load_ms(r, request.adapter) for r in replicas}

    async def ensure_loaded(
        self, replica: ReplicaState, adapter: str, *, last_resort: bool = False
    ) -> LoadResult:
        """See ``AdapterLoader.ensure_loaded``."""
        return await self.loader.ensure_loaded(replica, adapter, last_resort=last_resort)

    @contextlib.asynccontextmanager
    async def serving(
        self, replica: ReplicaState, adapter: str, *, last_resort: bool = False
    ) -> AsyncIterator[LoadResult]:
        """Hold ``adapter`` on ``replica`` for one upstream request.

        Marks the request in flight *before* loading (so no gateway evicts the adapter between
        its load and the request reaching the engine), ensures it is loaded, and yields the
        ``LoadResult``; the mark is removed on exit. Raises what ``ensure_loaded`` raises;
        ``NoAdapterSlot`` and ``ThrashGuardTripped`` mean "try another replica".
        """
        async with self.loader.in_use(replica.replica_id, adapter):
            yield await self.loader.ensure_loaded(replica, adapter, last_resort=last_resort)

    async def report_missing(self, replica: ReplicaId, adapter: str) -> None:
        """The engine answered 404 for an adapter believed resident (e.g. it restarted)."""
        with contextlib.suppress(PlacementUnavailable):
            await self.store.mark_unloaded(replica, adapter, self._clock())
            self.view.update(
                await self.store.snapshot(replica, self.guard.since(self._clock()))
            )

    # ------------------------------------------------------------------ engine truth

    async def refresh(self, states: Iterable[ReplicaState], *, trim: bool = True) -> None:
        """Fold the engines' reports into the store and re-read the view (periodic task).

        ``trim``: start unloading idle adapters past a replica's resident limit
        (``AdapterLoader.trim``), in the background, one trim per replica at a time, so a
        hung engine's unloads never hold up the refresh of the others. A read (the admin API)
        passes False."""
        now = self._clock()
        for state in states:
            rid = state.replica_id
            try:
                if state.healthy:
                    await self.store.sync_from_engine(
                        rid,
                        state.loaded_adapters | state.cpu_cached_adapters,
                        state.metrics_read_at,
                        self.settings.sync_grace_s,
                    )
                placement = await self.store.snapshot(rid, self.guard.since(now))
            except PlacementUnavailable as exc:
                if self._store_outage.failed(now):
                    log.warning(
                        "adapter placement refresh degraded: %s (%d refresh(es) so far; said "
                        "again at most once a minute)",
                        exc,
                        self._store_outage.failures,
                    )
                return
            self.view.update(placement)
            if trim and state.healthy:
                self._start_trim(state, placement)
            gpu = self.capacity(state).gpu
            used = len(placement.resident)
            self.metrics.set_slots_used(rid, used if gpu is None else min(used, gpu))
        if (ended := self._store_outage.recovered()) is not None:
            log.warning(
                "adapter placement store answers again after %d degraded refresh(es)", ended
            )

    async def trims_finished(self) -> None:
        """Wait for the trims ``refresh`` started (tests, and callers that must see their
        effect)."""
        await asyncio.gather(*self._trims.values(), return_exceptions=True)

    def _start_trim(self, state: ReplicaState, placement: ReplicaPlacement) -> None:
        limit = self.capacity(state).resident_limit
        running = self._trims.get(state.replica_id)
        if limit is None or len(placement.resident) <= limit or (running and not running.done()):
            return
        task = asyncio.create_task(self.loader.trim(state, placement), name="adapter-trim")
        task.add_done_callback(_log_trim_failure)
        self._trims[state.replica_id] = task

    async def forget_replica(self, replica: ReplicaId) -> None:
        """A replica left the fleet for good."""
        trim = self._trims.pop(replica, None)
        if trim is not None:
            trim.cancel()
        self.view.forget(replica)
        self.metrics.forget_replica(replica)
        with contextlib.suppress(PlacementUnavailable):
            await self.store.forget_replica(replica)

    # ------------------------------------------------------------------ admin

    def add(self, spec: Adapter | Mapping[str, Any], *, replace: bool = False) -> Adapter:
        """Add a runtime adapter (admin API); raises ``InvalidAdapter``. A replacement with
        another ``source`` must then be unloaded everywhere (``weights_changed``)."""
        return self.catalog.add(spec, replace=replace)

    def weights_changed(self, name: str, before: Adapter | None) -> bool:
        """True when ``name`` now names other weights than ``before`` did: replicas still
        holding the old ones would serve them under the name (vLLM loads by name and answers
        a second load of a loaded name with 'already loaded')."""
        now = self.catalog.find(name)
        return before is not None and (now is None or now.source != before.source)

    async def remove(self, name: str, states: Iterable[ReplicaState]) -> list[str]:
        """Remove a runtime adapter and unload it everywhere; returns failures as messages."""
        self.catalog.remove(name)
        return await self.unload_everywhere(name, states, reason="admin")

    async def unload_everywhere(
        self,
        name: str,
        states: Iterable[ReplicaState],
        *,
        reason: str,
        wait_idle_s: float = 0.0,
        only_replaced: bool = False,
    ) -> list[str]:
        """Unload ``name`` from every replica that holds it; returns failures as messages.

        ``wait_idle_s``: on each replica, first wait (up to this long) for the requests using it
        there to end; a reload that removed it unloaded it from under a stream (reload review).
        ``only_replaced``: the adapter was re-sourced; unload only other weights than its
        catalog ``source`` (a request may have loaded the new ones meanwhile) and wait only for
        the requests admitted for those.
        """
        current = self.catalog.find(name) if only_replaced else None
        keep = current.source if current is not None else None
        holders = [state for state in states if await self._may_hold(state, name)]
        outcomes = await asyncio.gather(
            *(self._unload_when_idle(state, name, reason, wait_idle_s, keep) for state in holders)
        )
        return [failure for failure in outcomes if failure is not None]

    async def _suspect_unrecorded(self, replica: ReplicaId, name: str) -> None:
        """A copy whose weights no gateway recorded (first seen in an engine report, written by
        an earlier release, or recorded in a Redis since restarted) was taken to hold the
        catalog's weights, after a re-source the new ones: the new owner was served the old.
        It is marked ``UNKNOWN_WEIGHTS`` so no request admitted now uses it, and its unload
        waits for every request (``AdapterLoader.unload``: one admitted after the reload may
        be using it already)."""
        try:
            status = await self.store.status(replica, name)
            if not status.resident or status.source is not None:
                return  # a recorded source (or the mark) already tells the weights apart
            # One step: a load that lands meanwhile keeps the source it records, and the copy
            # keeps its place in LRU order.
            await self.store.record_source_if_unknown(replica, name, UNKNOWN_WEIGHTS)
            self.view.update(await self.store.snapshot(replica, self.guard.since(self._clock())))
        except PlacementUnavailable:
            pass

    async def _may_hold(self, state: ReplicaState, name: str) -> bool:
        """True if ``state``'s replica holds ``name``, or a load of it is under way there (a load
        begun before a reload finishes with the weights it began with: the live review found
        such copies never unloaded, one name serving two sets of weights)."""
        view = self.view.get(state.replica_id)
        if name in state.loaded_adapters or (view is not None and name in view.resident):
            return True
        try:
            return (await self.store.status(state.replica_id, name)).busy
        except PlacementUnavailable:
            return False

    async def _unload_when_idle(
        self, state: ReplicaState, name: str, reason: str, wait_idle_s: float,
        keep_source: str | None,
    ) -> str | None:
        """Unload once no request uses the weights to go (``AdapterLoader.unload``'s count,
        taken with the adapter's lock held), checking every few polls; past ``wait_idle_s``,
        anyway."""
        deadline = time.monotonic() + wait_idle_s
        if keep_source is not None:
            await self._suspect_unrecorded(state.replica_id, name)
        while True:
            waiting = time.monotonic() < deadline
            try:
                await self.loader.unload(
                    state, name, reason=reason, if_idle=waiting, keep_source=keep_source
                )
            except AdapterUnloadFailed as exc:
                if waiting and exc.engine_message == IN_USE:
                    await asyncio.sleep(10 * self.loader.settings.poll_interval_s)
                    continue
                return str(exc)
            except AdapterError as exc:
                return str(exc)
            return None

    # ------------------------------------------------------------------ pre-warming

    def plan(self, states: Sequence[ReplicaState]) -> ReplicationPlan:
        """The replication plan for the healthy ``states`` from recent traffic (no I/O).

        Planned per base model, among the replicas that serve it: an adapter loads only where
        its base model runs (elsewhere vLLM would refuse it, or hold it in a slot no request can
        use). A replica serving several models sees each model's plan after the previous ones'.
        """
        counts = self.traffic.counts(self._clock())
        demands: dict[str, list[AdapterDemand]] = {}
        for a in self.catalog:
            if self.failures.recently_failed(a.name):
                # Its loads are failing (a broken source): the requests asking for it fail, so
                # they must not make room for it by evicting adapters that work.
                demand = AdapterDemand(a.name, 0, a.pinned, 0)
            else:
                demand = AdapterDemand(a.name, counts.get(a.name, 0), a.pinned, a.prewarm_replicas)
            demands.setdefault(a.base_model, []).append(demand)
        usable = [
            s for s in states
            # pre-warming a replica whose loads fail would only fail again
            if s.healthy and not self.failures.avoided(s.replica_id)
        ]
        resident: dict[ReplicaId, set[str]] = {}
        busy: dict[ReplicaId, frozenset[str]] = {}
        for state in usable:
            view = self.view.get(state.replica_id)
            resident[state.replica_id] = set(
                view.resident if view is not None else state.loaded_adapters
            )
            busy[state.replica_id] = frozenset(view.inflight if view is not None else ())
        desired: dict[str, int] = {}
        steps: list[PlanStep] = []
        for model in sorted(demands):
            slots = [
                ReplicaSlots(
                    s.replica_id, self.capacity(s).resident_limit,
                    frozenset(resident[s.replica_id]), busy[s.replica_id],
                )
                for s in usable if s.serves(model)
            ]
            part = plan_replication(demands[model], slots, self.settings.prewarm)
            desired.update(part.desired)
            steps.extend(part.steps)
            for step in part.steps:
                resident[step.replica].add(step.adapter)
                resident[step.replica].discard(step.evict or "")
        return ReplicationPlan(desired, steps)

    async def share_traffic(self) -> None:
        """Write this gateway's pre-warm traffic to the store, and read the others' back."""
        await self.traffic.sync(self.store, self._clock())

    async def prewarm(self, states: Sequence[ReplicaState]) -> ReconcileReport:
        """Share traffic counts with the other gateways, plan, and carry out the plan."""
        await self.share_traffic()
        plan = self.plan(states)
        return await reconcile(plan, self.loader, {s.replica_id: s for s in states})

    async def run(
        self,
        get_states: Callable[[], Sequence[ReplicaState]],
        refresh_interval_s: float = 2.0,
        prewarm_interval_s: float | None = 30.0,
        on_prewarm: Callable[[ReconcileReport], None] | None = None,
    ) -> None:
        """Refresh (and pre-warm, unless ``prewarm_interval_s`` is None) until cancelled;
        ``on_prewarm`` hears each pre-warm's report (the gateway learns from its refusals)."""
        last_prewarm = float("-inf")
        while True:
            try:
                states = get_states()
                await self.refresh(states)
                now = time.monotonic()
                if prewarm_interval_s is not None and now - last_prewarm >= prewarm_interval_s:
                    last_prewarm = now
                    report = await self.prewarm(states)
                    if on_prewarm is not None:
                        on_prewarm(report)
            except asyncio.CancelledError:
                raise
            except Exception:  # a background loop must survive any one bad round
                log.exception("adapter registry background round failed")
            await asyncio.sleep(refresh_interval_s)

    async def close(self) -> None:
        """Cancel loads and trims in progress and close the store."""
        trims = [task for task in self._trims.values() if not task.done()]
        for task in trims:
            task.cancel()
        await asyncio.gather(*trims, return_exceptions=True)
        await self.loader.close()
        await self.store.close()


def _log_trim_failure(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("unloading adapters past a replica's limit failed: %s", task.exception())
