"""Ensure-loaded: make an adapter resident on a replica, once, whatever the number of gateways.

Three layers keep a (replica, adapter) pair to one load at a time:

1. In this gateway, concurrent callers share one load task (``asyncio`` dedup), so a burst of
   requests for a cold adapter makes one HTTP call.
2. Across gateways, a lock in the placement store (Redis ``SET NX PX``, with expiry so a dead
   gateway cannot block forever). A gateway that finds the lock held polls until the adapter is
   resident or the lock is gone (then it tries to take it itself).
3. The engine: vLLM answers 400 "already loaded" to a duplicate, which counts as success.

When the replica's slots are full, the least recently used adapter that is neither pinned nor
serving requests is unloaded first (its lock taken too, so two gateways never evict the same
one). If none qualifies, ``NoAdapterSlot`` tells the gateway to try another replica.

If the placement store is down the loader degrades rather than fails: it skips the cross-gateway
lock and slot accounting (the engine still refuses duplicates) and logs that it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from adapters_registry.catalog import AdapterCatalog
from adapters_registry.cold_start import LoadTimeModel
from adapters_registry.engine_api import LoraEngineApi
from adapters_registry.errors import (
    AdapterLoadFailed,
    AdapterUnloadFailed,
    NoAdapterSlot,
    OldWeightsInUse,
    ReplicaLoadsFailing,
    ThrashGuardTripped,
)
from adapters_registry.load_failures import REPLICA, LoadFailures, party_of
from adapters_registry.metrics import AdapterMetrics
from adapters_registry.paths import engine_path
from adapters_registry.placement import (
    AdapterStatus,
    PlacementStore,
    PlacementUnavailable,
    ReplicaPlacement,
    Residency,
    SlotCapacity,
    eviction_candidates,
    needs_room,
)
from adapters_registry.thrash import ThrashGuard
from adapters_registry.view import PlacementView
from routing.config import Adapter
from routing.state import ReplicaState
from routing.types import ReplicaId

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LoadResult:
    """Outcome of ``ensure_loaded``."""

    #: Time this caller waited for the adapter (0 when it was already resident), ms.
    cold_ms: float
    #: True for the one caller whose call made the engine load it.
    loaded_now: bool


@dataclass(frozen=True)
class LoaderSettings:
    """Timeouts of the loader; the defaults suit multi-second loads from network storage."""

    #: Longest a load (or unload) HTTP call may take.
    load_timeout_s: float = 60.0
    #: Expiry of the cross-gateway lock; must outlast a load plus the unloads that make room.
    lock_ttl_s: float = 90.0
    #: How often a gateway waiting on another gateway's load re-reads the store.
    poll_interval_s: float = 0.05
    #: Longest a caller waits on another gateway's load before giving up.
    wait_timeout_s: float = 120.0
    #: Expiry of a request's in-flight mark if the gateway dies before ending it.
    lease_ttl_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("load_timeout_s", "lock_ttl_s", "poll_interval_s", "wait_timeout_s",
                     "lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        if self.lock_ttl_s <= self.load_timeout_s:
            raise ValueError(
                f"lock_ttl_s ({self.lock_ttl_s}) must be > load_timeout_s ({self.load_timeout_s}):"
                " a lock that expires mid-load lets a second gateway load the same adapter"
            )


#: ``AdapterUnloadFailed``'s reason when ``unload(if_idle=True)`` finds a request using it.
IN_USE = "a request is using it"

#: The ``source`` recorded for a copy whose weights nobody recorded, once a reload changed the
#: adapter's source: it may hold the old weights, so no request admitted after the reload is
#: served by it (``Residency.serves_weights`` is False for any catalog source).
UNKNOWN_WEIGHTS = "|unknown"

#: Between a lease's id and the ``source`` of the weights its request was admitted for.
LEASE_SEP = "|"


def lease_source(lease: str) -> str:
    """The ``source`` a lease (``in_use``) was taken for; ``""`` for a lease without one."""
    return lease.partition(LEASE_SEP)[2]


#: The name under which the store locks a whole replica's room (``_load_with_room``): no
#: adapter's, as adapter names never hold ``|``.
ROOM_LOCK = "|room"


class AdapterLoader:
    """Loads and unloads adapters on replicas, keeping the placement store and view current."""

    def __init__(
        self,
        catalog: AdapterCatalog,
        store: PlacementStore,
        engine: LoraEngineApi,
        view: PlacementView,
        capacity: Callable[[ReplicaState], SlotCapacity],
        *,
        metrics: AdapterMetrics,
        load_times: LoadTimeModel,
        guard: ThrashGuard,
        failures: LoadFailures | None = None,
        settings: LoaderSettings | None = None,
        gateway_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._catalog = catalog
        self._store = store
        self._engine = engine
        self._view = view
        self._capacity = capacity
        self._metrics = metrics
        self._load_times = load_times
        self._guard = guard
        self._failures = failures if failures is not None else LoadFailures()
        self.settings = settings or LoaderSettings()
        self._gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self._clock = clock
        self._tasks: dict[tuple[ReplicaId, str], asyncio.Task[LoadResult]] = {}
        #: The ``source`` each of those loads, and when it began (monotonic seconds).
        self._task_meta: dict[tuple[ReplicaId, str], tuple[str, float]] = {}
        #: Adapters a reload re-sourced: unrecorded copies of them are not trusted (``serves``).
        self._distrusted: set[str] = set()
        #: Callers currently waiting on each in-process load (diagnostics and tests).
        self._sharers: dict[tuple[ReplicaId, str], int] = {}
        #: Times a load found another gateway's lock held and waited for it.
        self.lock_contentions = 0
        #: One load at a time per replica from this gateway, from the room it makes to the
        #: adapter marked resident: loads of different adapters read the same placement, each
        #: saw room, and a replica ended with six adapters resident against a limit of four.
        self._replica_locks: dict[ReplicaId, asyncio.Lock] = {}
        #: When this gateway last released each replica's room lock (``_take_room``).
        self._room_released: dict[ReplicaId, float] = {}

    # ------------------------------------------------------------------ public API

    async def ensure_loaded(
        self, replica: ReplicaState, adapter: str, *, last_resort: bool = False
    ) -> LoadResult:
        """Make ``adapter`` resident on ``replica``; returns at once if it already is.

        ``last_resort``: no other replica can serve the request, so load even past the thrash
        guard. Raises ``AdapterNotFound`` (not in the catalog), ``ThrashGuardTripped``,
        ``NoAdapterSlot``, or ``AdapterLoadFailed`` (engine refused, timeout, unreachable).
        """
        entry = self._catalog.get(adapter)
        started = time.monotonic()
        key = (replica.replica_id, adapter)
        task = await self._shareable(key, entry.source)
        if task is None:
            status = await self._status(replica.replica_id, adapter)
            if self.serves(status, entry) and not status.busy:
                await self._quiet(self._store.touch(replica.replica_id, adapter, self._clock()))
                return LoadResult(cold_ms=0.0, loaded_now=False)
            # another caller may have started one meanwhile
            task = await self._shareable(key, entry.source)
        if task is not None:
            try:
                return await self._share(key, task, started)
            except (ThrashGuardTripped, ReplicaLoadsFailing):
                if not last_resort:
                    raise
                # The shared attempt was not a last resort; this caller's is.
                return await self.ensure_loaded(replica, adapter, last_resort=True)
        task = asyncio.create_task(self._load_or_wait(replica, entry, last_resort, started))
        self._tasks[key] = task
        self._task_meta[key] = (entry.source, time.monotonic())
        task.add_done_callback(lambda t, key=key: self._load_done(key, t))
        # Shielded: a caller that gives up (client disconnect) must not abort the load that
        # other callers share, nor leave the cross-gateway lock to expire.
        return await asyncio.shield(task)

    async def unload(
        self,
        replica: ReplicaState,
        adapter: str,
        *,
        reason: str = "admin",
        if_idle: bool = False,
        keep_source: str | None = None,
    ) -> bool:
        """Unload ``adapter`` from ``replica`` (admin removal, pre-warm rebalancing, a reload).

        Returns False if the engine did not have it. Waits for a load or unload in progress.
        Raises ``AdapterUnloadFailed``; with ``if_idle`` (a rebalancing that can wait) that too
        when a request is using it, and nothing is unloaded. ``keep_source``: unload only other
        weights than those (a reload's re-sourced adapter: a request may have loaded the new
        ones meanwhile), and with ``if_idle`` count only the requests using other weights.
        """
        rid = replica.replica_id
        owner = self._owner()
        deadline = time.monotonic() + self.settings.wait_timeout_s
        while not await self._try_lock(rid, adapter, owner):
            if time.monotonic() >= deadline:
                raise AdapterUnloadFailed(adapter, rid, "another load or unload is still running")
            await asyncio.sleep(self.settings.poll_interval_s)
        try:
            # With the lock held any new request waits for us, so this re-read is current (the
            # plan that chose it may have read a view seconds old).
            besides = None
            if keep_source is not None:
                held = (await self._status(rid, adapter)).source
                if held == keep_source:
                    return False
                # Weights nobody recorded may be the new ones too: every request may use them.
                besides = keep_source if held not in (None, UNKNOWN_WEIGHTS) else None
            if if_idle and await self.requests_on(rid, adapter, besides_source=besides) > 0:
                raise AdapterUnloadFailed(adapter, rid, IN_USE)
            return await self._unload_locked(replica, adapter, reason)
        finally:
            await self._unlock(rid, adapter, owner)

    @contextlib.asynccontextmanager
    async def in_use(self, replica: ReplicaId, adapter: str) -> AsyncIterator[None]:
        """Mark a request in flight on (replica, adapter) so no gateway evicts it meanwhile.

        The lease names the weights the request was admitted for (the catalog's ``source`` now),
        so a reload that re-sources the adapter can tell the requests still using the old
        weights (``requests_on``) from those waiting for the new ones."""
        entry = self._catalog.find(adapter)
        lease = f"{uuid.uuid4().hex}{LEASE_SEP}{entry.source if entry is not None else ''}"
        await self._quiet(self._store.begin_use(replica, adapter, lease, self.settings.lease_ttl_s))
        try:
            yield
        finally:
            await self._quiet(self._store.end_use(replica, adapter, lease))

    async def requests_on(
        self, replica: ReplicaId, adapter: str, *, besides_source: str | None = None
    ) -> int:
        """Requests in flight on ``adapter`` there, from every gateway (0 if the store is down);
        with ``besides_source``, only those admitted for other weights than those (the ones a
        re-sourced adapter's old copy still serves)."""
        if besides_source is None:
            return (await self._snapshot(replica)).inflight.get(adapter, 0)
        leases = await self._quiet(self._store.leases(replica, adapter)) or []
        return sum(1 for lease in leases if lease_source(lease) != besides_source)

    def distrust_unrecorded(self, names: Iterable[str]) -> None:
        """A reload re-sourced ``names``: a copy of one whose weights nobody recorded may hold
        the old ones, and is served to no request from now on (``serves``). At once, in the
        reload: the store's mark (``UNKNOWN_WEIGHTS``) comes from a background task, and a
        request admitted meanwhile was served the old weights (the mends review)."""
        self._distrusted.update(names)

    def serves(self, held: AdapterStatus | Residency, entry: Adapter) -> bool:
        """True if ``held`` (a read of one replica's copy) has ``entry``'s weights."""
        if held.resident and held.source is None and entry.name in self._distrusted:
            return False
        return held.serves_weights(entry.source)

    def loading_for_s(self, replica: ReplicaId, adapter: str, source: str) -> float | None:
        """Seconds this gateway's load of ``adapter``'s weights at ``source`` onto ``replica``
        has been under way, or None when none is (a load of other weights included)."""
        meta = self._task_meta.get((replica, adapter))
        if meta is None or meta[0] != source:
            return None
        return time.monotonic() - meta[1]

    def waiting(self, replica: ReplicaId, adapter: str) -> int:
        """Callers in this gateway waiting on an in-process load (0 when none runs)."""
        if (replica, adapter) not in self._tasks:
            return 0
        return 1 + self._sharers.get((replica, adapter), 0)

    async def close(self) -> None:
        """Cancel loads still running (on gateway shutdown)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ in-process dedup

    async def _share(
        self, key: tuple[ReplicaId, str], task: asyncio.Task[LoadResult], started: float
    ) -> LoadResult:
        self._sharers[key] = self._sharers.get(key, 0) + 1
        try:
            await asyncio.shield(task)
        finally:
            self._sharers[key] -= 1
            if not self._sharers[key]:
                del self._sharers[key]
        return LoadResult(cold_ms=_elapsed_ms(started), loaded_now=False)

    async def _shareable(
        self, key: tuple[ReplicaId, str], source: str
    ) -> asyncio.Task[LoadResult] | None:
        """This gateway's load in progress of (replica, adapter) if it loads the weights at
        ``source``, else None. A load of other weights (begun before a reload re-sourced the
        adapter) is waited out first, never shared: sharing it served a request admitted after
        the reload the old weights, the old owner's to a new owner (the LoRA-reload review)."""
        while True:
            task = self._tasks.get(key)
            meta = self._task_meta.get(key)
            if task is None or task.done() or (meta is not None and meta[0] == source):
                return task if task is not None and not task.done() else None
            await asyncio.wait({task})  # its outcome is its own callers'

    def _load_done(self, key: tuple[ReplicaId, str], task: asyncio.Task[LoadResult]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
            self._task_meta.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here, so an unshared failure is not logged as lost

    def loads_failing(self, replica: ReplicaId, adapter: str | None = None) -> bool:
        """True while this replica's loads (of ``adapter``'s party's adapters) are avoided
        (``load_failures.py``)."""
        party = party_of(self._catalog.find(adapter)) if adapter is not None else REPLICA
        return self._failures.avoided(replica, party)

    # ------------------------------------------------------------------ the load itself

    async def _load_or_wait(
        self, replica: ReplicaState, entry: Adapter, last_resort: bool, started: float
    ) -> LoadResult:
        rid, name = replica.replica_id, entry.name
        owner = self._owner()
        deadline = time.monotonic() + self.settings.wait_timeout_s
        while True:
            if await self._try_lock(rid, name, owner):
                try:
                    return await self._load_locked(replica, entry, last_resort, started, owner)
                finally:
                    await self._unlock(rid, name, owner)
            # Another gateway is loading (or unloading) it: wait for the outcome.
            self.lock_contentions += 1
            status = await self._status(rid, name)
            if self.serves(status, entry) and not status.busy:
                return LoadResult(cold_ms=_elapsed_ms(started), loaded_now=False)
            if time.monotonic() >= deadline:
                waited = self.settings.wait_timeout_s
                raise AdapterLoadFailed(
                    name, rid, f"another gateway's load did not finish within {waited:g}s"
                )
            await asyncio.sleep(self.settings.poll_interval_s)

    async def _load_locked(
        self, replica: ReplicaState, entry: Adapter, last_resort: bool, started: float,
        owner: str,
    ) -> LoadResult:
        rid, name = replica.replica_id, entry.name
        async with self._replica_locks.setdefault(rid, asyncio.Lock()):
            # Double-checked, once both locks are held: the gateway that held the adapter's lock
            # before us, or this gateway's loads we waited behind, may have just loaded it.
            if self.serves(await self._status(rid, name), entry):
                return LoadResult(cold_ms=_elapsed_ms(started), loaded_now=False)
            if self._failures.avoided(rid, party_of(entry)) and not last_resort:
                # The load before this one failed (a hung loader, a missing mount): fall back now
                # rather than wait out another load timeout in line behind it.
                raise ReplicaLoadsFailing(
                    name, rid, "adapter loads on this replica have been failing; not tried yet"
                )
            # And one load at a time on the replica across gateways: two gateways loading
            # different adapters each read the same placement, saw room, and a replica with
            # room for two held three, with nothing to bring it back (the pre-warm review).
            await self._take_room(rid, name, owner)
            try:
                # Checked again: another gateway may have loaded it while this one waited (its
                # adapter lock can expire meanwhile); loading it again would evict for nothing.
                status = await self._status(rid, name)
                if self.serves(status, entry):
                    return LoadResult(cold_ms=_elapsed_ms(started), loaded_now=False)
                if status.resident:
                    await self._drop_old_weights(replica, entry)
                return await self._load_with_room(replica, entry, last_resort, started, owner)
            finally:
                await self._unlock(rid, ROOM_LOCK, owner)
                self._room_released[rid] = time.monotonic()

    async def _take_room(self, replica: ReplicaId, adapter: str, owner: str) -> None:
        """Wait for the replica's room lock (``ROOM_LOCK``); ``AdapterLoadFailed`` past
        ``wait_timeout_s``. Its holder never waits on a lock a waiter holds (victims are taken
        with ``try_lock`` or skipped), so waiting cannot deadlock.

        A gateway that has just released it waits two polls before taking it again: its next
        load would otherwise take it at once, every time, while other gateways poll for it, and
        one gateway's queue of loads could starve another's single one."""
        released = self._room_released.get(replica)
        if released is not None:
            pause = released + 2 * self.settings.poll_interval_s - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
        deadline = time.monotonic() + self.settings.wait_timeout_s
        while not await self._try_lock(replica, ROOM_LOCK, owner):
            self.lock_contentions += 1
            if time.monotonic() >= deadline:
                waited = self.settings.wait_timeout_s
                raise AdapterLoadFailed(
                    adapter, replica,
                    f"other gateways held this replica's loads for {waited:g}s",
                )
            await asyncio.sleep(self.settings.poll_interval_s)

    async def _load_with_room(
        self, replica: ReplicaState, entry: Adapter, last_resort: bool, started: float,
        owner: str,
    ) -> LoadResult:
        """Make room and load, this gateway's only load on the replica (``_replica_locks``):
        the placement read here counts every load it made before."""
        rid, name = replica.replica_id, entry.name
        placement = await self._snapshot(rid)
        loads = self._guard.loads_in_window(placement.recent_loads, self._clock())
        if loads >= self._guard.settings.max_loads and not last_resort:
            self._metrics.thrash_event(rid)
            s = self._guard.settings
            raise ThrashGuardTripped(name, rid, loads, s.max_loads, s.window_s)
        await self._make_room(replica, name, placement, owner)
        t0 = time.monotonic()
        try:
            reply = await self._engine.load(replica.url, rid, name, engine_path(entry.source))
        except AdapterLoadFailed as exc:
            self._metrics.load(name, rid, ok=False, source=entry.source)
            self._failures.failed(
                rid, name, replica_fault=exc.status is None or exc.status >= 500,
                party=party_of(entry),
            )
            raise
        self._failures.succeeded(rid, name, party_of(entry))
        load_s = time.monotonic() - t0
        now = self._clock()
        await self._quiet(self._store.mark_resident(rid, name, now, entry.source))
        if reply.changed:
            await self._quiet(self._store.record_load(rid, now, self._guard.settings.window_s))
            self._load_times.observe(name, rid, load_s * 1000.0)
            self._metrics.load(name, rid, ok=True, seconds=load_s, source=entry.source)
        await self._refresh_view(rid)
        return LoadResult(cold_ms=_elapsed_ms(started), loaded_now=reply.changed)

    async def _drop_old_weights(self, replica: ReplicaState, entry: Adapter) -> None:
        """Unload the weights a reload replaced (the adapter's lock is held): vLLM answers a
        load of a loaded name "already loaded" and would go on serving the old ones under it,
        to a new owner too. ``OldWeightsInUse`` while requests admitted for them still run."""
        rid = replica.replica_id
        using = await self.requests_on(rid, entry.name, besides_source=entry.source)
        if using:
            raise OldWeightsInUse(entry.name, rid, using)
        await self._unload_locked(replica, entry.name, "replaced")

    async def _make_room(
        self, replica: ReplicaState, adapter: str, placement: ReplicaPlacement, owner: str
    ) -> None:
        capacity = self._capacity(replica)
        excess = needs_room(placement, capacity)
        if excess == 0:
            return
        if await self._evict(replica, placement, excess, {adapter}, owner) < excess:
            blocked = sorted(placement.resident - {adapter})
            raise NoAdapterSlot(adapter, replica.replica_id, capacity.resident_limit or 0, blocked)

    async def _evict(
        self, replica: ReplicaState, placement: ReplicaPlacement, count: int,
        keep: set[str], owner: str,
    ) -> int:
        """Unload up to ``count`` idle, unpinned adapters, least recently used first, none in
        ``keep``; returns how many went."""
        pinned = {a.name for a in self._catalog if a.pinned}
        evicted = 0
        for victim in eviction_candidates(placement, pinned, keep=keep):
            if evicted == count:
                break
            # The victim's own lock: two gateways making room never pick the same adapter, and
            # a victim that someone is loading right now is skipped.
            if not await self._try_lock(replica.replica_id, victim, owner):
                continue
            try:
                # A request may have started on it since the snapshot; with the lock held, any
                # later one waits for us, so this re-read closes the window.
                if (await self._snapshot(replica.replica_id)).inflight.get(victim, 0) > 0:
                    continue
                await self._unload_locked(replica, victim, "lru")
                evicted += 1
            except AdapterUnloadFailed as exc:
                log.warning("%s", exc)
            finally:
                await self._unlock(replica.replica_id, victim, owner)
        return evicted

    async def trim(self, replica: ReplicaState, placement: ReplicaPlacement) -> int:
        """Unload idle adapters past the replica's resident limit (least recently used first),
        e.g. after a reload lowered ``max_cpu_loras``: loads only ever made room for one more,
        so a lowered limit was never reached (the LoRA-reload review: 3 resident against 1 for
        as long as it watched). Skipped while a load holds the replica's room; returns how many
        went."""
        limit = self._capacity(replica).resident_limit
        if limit is None or len(placement.resident) <= limit:
            return 0
        rid = replica.replica_id
        loading = self._replica_locks.get(rid)
        if loading is not None and loading.locked():
            return 0  # this gateway is loading there (with the store down the room lock is moot)
        owner = self._owner()
        if not await self._try_lock(rid, ROOM_LOCK, owner):
            return 0  # a load is making room there; the next round looks again
        try:
            placement = await self._snapshot(rid)  # current, with the room held
            excess = len(placement.resident) - limit
            if excess <= 0:
                return 0
            # Only adapters a gateway can load again: one the engine was started with
            # (``--lora-modules``) or someone else loaded is not this gateway's to remove.
            foreign = {name for name in placement.resident if self._catalog.find(name) is None}
            return await self._evict(replica, placement, excess, foreign, owner)
        finally:
            await self._unlock(rid, ROOM_LOCK, owner)

    async def _unload_locked(self, replica: ReplicaState, adapter: str, reason: str) -> bool:
        rid = replica.replica_id
        weights = (await self._status(rid, adapter)).source  # for its metrics label
        reply = await self._engine.unload(replica.url, rid, adapter)
        await self._quiet(self._store.mark_unloaded(rid, adapter, self._clock()))
        if reply.changed:
            self._metrics.unload(adapter, rid, reason, source=weights)
        await self._refresh_view(rid)
        return reply.changed

    # ------------------------------------------------------------------ store, degraded

    def _owner(self) -> str:
        return f"{self._gateway_id}:{uuid.uuid4().hex[:8]}"

    async def _refresh_view(self, replica: ReplicaId) -> None:
        placement = await self._quiet(
            self._store.snapshot(replica, self._guard.since(self._clock()))
        )
        if placement is not None:
            self._view.update(placement)

    async def _status(self, replica: ReplicaId, adapter: str) -> AdapterStatus:
        status = await self._quiet(self._store.status(replica, adapter))
        return status if status is not None else AdapterStatus(resident=False, busy=False)

    async def _snapshot(self, replica: ReplicaId) -> ReplicaPlacement:
        placement = await self._quiet(
            self._store.snapshot(replica, self._guard.since(self._clock()))
        )
        return placement if placement is not None else ReplicaPlacement(replica)

    async def _try_lock(self, replica: ReplicaId, adapter: str, owner: str) -> bool:
        taken = await self._quiet(
            self._store.try_lock(replica, adapter, owner, self.settings.lock_ttl_s)
        )
        # Store down: go ahead unlocked; in-process dedup and vLLM's own check still hold.
        return True if taken is None else taken

    async def _unlock(self, replica: ReplicaId, adapter: str, owner: str) -> None:
        await self._quiet(self._store.unlock(replica, adapter, owner))

    @staticmethod
    async def _quiet(op: Awaitable[T]) -> T | None:
        try:
            return await op
        except PlacementUnavailable as exc:
            log.warning("adapter placement degraded: %s", exc)
            return None


def _elapsed_ms(started: float) -> float:
    return (time.monotonic() - started) * 1000.0
