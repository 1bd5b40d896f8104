"""Loader mechanics against a fake engine API (no sockets): dedup, LRU eviction, guards, errors.

The HTTP side is covered against simulated vLLM replicas in tests/integration.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from adapters_registry.errors import (
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterUnloadFailed,
    NoAdapterSlot,
    ThrashGuardTripped,
)
from adapters_registry.placement_memory import MemoryPlacementStore
from adapters_registry.prewarm import reconcile
from adapters_registry.registry import AdapterRegistry, RegistrySettings
from adapters_registry.thrash import ThrashSettings
from routing.state import ReplicaState
from tests.unit.test_adapters_fixtures import FakeEngine, adapter, make_policy, replica


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


POLICY = make_policy(
    [adapter(n) for n in "abcde"] + [adapter("pin", pinned=True)]
)


@pytest.fixture
async def setup() -> AsyncIterator[tuple[AdapterRegistry, FakeEngine, Clock]]:
    clock = Clock()
    engine = FakeEngine()
    settings = RegistrySettings(thrash=ThrashSettings(max_loads=4, window_s=60))
    reg = AdapterRegistry.in_memory(
        POLICY, engine,  # the fake replaces HTTP; everything else is real
        settings=settings, metrics_registry=CollectorRegistry(), clock=clock,
    )
    yield reg, engine, clock
    await reg.close()


def full(max_cpu_loras: int) -> ReplicaState:
    return replica("r0", max_loras=1, max_cpu_loras=max_cpu_loras)


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until ``condition`` holds (bounded, so a bug fails the test)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


async def test_resident_adapter_needs_no_load(setup: tuple[AdapterRegistry, FakeEngine, Clock]):
    reg, engine, _ = setup
    first = await reg.ensure_loaded(full(4), "a")
    again = await reg.ensure_loaded(full(4), "a")
    assert first.loaded_now and not again.loaded_now
    assert again.cold_ms == 0.0
    assert engine.calls == [("load", "a")]


async def test_concurrent_callers_share_one_load(setup: tuple[AdapterRegistry, FakeEngine, Clock]):
    reg, engine, _ = setup
    engine.gate = asyncio.Event()
    state = full(4)
    tasks = [asyncio.create_task(reg.ensure_loaded(state, "a")) for _ in range(5)]
    await until(lambda: reg.loader.waiting(state.replica_id, "a") == 5)
    engine.gate.set()
    results = await asyncio.gather(*tasks)
    assert engine.calls == [("load", "a")]
    assert sum(r.loaded_now for r in results) == 1


async def test_a_caller_giving_up_does_not_abort_the_shared_load(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    reg, engine, _ = setup
    engine.gate = asyncio.Event()
    state = full(4)
    first = asyncio.create_task(reg.ensure_loaded(state, "a"))
    second = asyncio.create_task(reg.ensure_loaded(state, "a"))
    await until(lambda: reg.loader.waiting(state.replica_id, "a") == 2)
    first.cancel()
    engine.gate.set()
    assert (await second).loaded_now is False
    assert "a" in engine.loaded
    assert (await reg.store.status(state.replica_id, "a")).resident


async def test_full_replica_evicts_least_recently_used(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    reg, engine, clock = setup
    state = full(3)
    for name in ("a", "b", "c"):
        clock.now += 1
        await reg.ensure_loaded(state, name)
    clock.now += 1
    async with reg.serving(state, "a"):  # a is used again: b is now the oldest
        pass
    clock.now += 1
    await reg.ensure_loaded(state, "d")
    assert engine.calls[-2:] == [("unload", "b"), ("load", "d")]
    assert engine.loaded == {"a", "c", "d"}
    assert reg.view.get(state.replica_id).resident == {"a", "c", "d"}


async def test_pinned_and_busy_adapters_are_never_evicted(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    reg, engine, clock = setup
    state = full(2)
    clock.now += 1
    await reg.ensure_loaded(state, "pin")
    clock.now += 1
    async with reg.serving(state, "a"):
        clock.now += 1
        with pytest.raises(NoAdapterSlot) as err:
            await reg.ensure_loaded(state, "b")
    assert err.value.blocked == ["a", "pin"]
    assert engine.loaded == {"pin", "a"}
    # Once a's request ended, a can go; pin still stays.
    await reg.ensure_loaded(state, "b")
    assert engine.loaded == {"pin", "b"}


async def test_thrash_guard_refuses_unless_last_resort(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    reg, engine, clock = setup
    state = full(8)
    for name in "abcd":
        await reg.ensure_loaded(state, name)
    with pytest.raises(ThrashGuardTripped, match="already loaded 4 adapters"):
        await reg.ensure_loaded(state, "e")
    assert "e" not in engine.loaded
    assert reg.metrics.thrash_events.labels(replica="r0")._value.get() == 1
    assert reg.cold_load_ms(state, "pin") == reg.settings.thrash.penalty_ms
    await reg.ensure_loaded(state, "e", last_resort=True)
    assert "e" in engine.loaded
    clock.now += 61  # the window moved on
    assert reg.cold_load_ms(state, "pin") < reg.settings.thrash.penalty_ms
    assert (await reg.ensure_loaded(state, "pin")).loaded_now


async def test_engine_failure_is_reported_and_not_remembered(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    reg, engine, _ = setup
    engine.fail_with = AdapterLoadFailed("a", "r0", "No adapter found for /adapters/acme/a", 400)
    with pytest.raises(AdapterLoadFailed, match="No adapter found"):
        await reg.ensure_loaded(full(4), "a")
    assert not (await reg.store.status(full(4).replica_id, "a")).resident
    a = reg.catalog.metrics_label("a")  # a private adapter: an opaque label
    failed = reg.metrics.loads.labels(adapter=a, replica="r0", outcome="failed")
    assert failed._value.get() == 1
    engine.fail_with = None
    assert (await reg.ensure_loaded(full(4), "a")).loaded_now


async def test_already_loaded_on_engine_counts_as_success(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    reg, engine, _ = setup
    engine.loaded.add("a")  # loaded by someone else, unknown to the store
    result = await reg.ensure_loaded(full(4), "a")
    assert result.loaded_now is False
    assert (await reg.store.status(full(4).replica_id, "a")).resident


async def test_unknown_adapter_is_not_found(setup: tuple[AdapterRegistry, FakeEngine, Clock]):
    reg, engine, _ = setup
    with pytest.raises(AdapterNotFound):
        await reg.ensure_loaded(full(4), "nope")
    assert engine.calls == []


async def test_a_rebalancing_unload_leaves_an_adapter_a_request_is_using(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    reg, engine, _ = setup
    state = full(2)
    await reg.ensure_loaded(state, "a")
    async with reg.serving(state, "a"):
        with pytest.raises(AdapterUnloadFailed, match="a request is using it"):
            await reg.loader.unload(state, "a", reason="prewarm", if_idle=True)
        assert engine.loaded == {"a"}
    assert await reg.loader.unload(state, "a", reason="prewarm", if_idle=True)
    assert engine.loaded == set()


async def test_concurrent_loads_of_different_adapters_keep_the_replica_within_its_limit(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    # Each load read the placement before the others had loaded, saw room and loaded: six
    # adapters resident against a limit of four, and none ever evicted.
    reg, engine, _ = setup
    state = full(2)
    engine.gate = asyncio.Event()
    tasks = [asyncio.create_task(reg.ensure_loaded(state, name)) for name in ("a", "b", "c")]
    for _ in range(200):  # every load as far as it gets before the engine answers
        await asyncio.sleep(0)
    assert engine.calls == [("load", "a")]  # the others wait their turn on the replica
    engine.gate.set()
    await asyncio.gather(*tasks)
    assert len(engine.loaded) == 2 and "c" in engine.loaded
    assert reg.view.get(state.replica_id).resident == engine.loaded
    assert len([call for call in engine.calls if call[0] == "unload"]) == 1


async def test_a_replica_whose_loads_fail_is_priced_out_of_cold_loads_for_a_while(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    # Its health checks pass, so nothing else kept new adapters away: each one routed there cold
    # paid a failed load (or, hung, the whole load timeout) before its fallback.
    reg, engine, clock = setup
    state = full(4)
    healthy = replica("r1", max_loras=1, max_cpu_loras=4)
    normal = reg.cold_load_ms(state, "b")
    # One adapter refused (a 4xx: bad weights, a rank over the engine's limit) is its own
    # fault: other adapters load there fine. A second adapter refused there is the replica's
    # (vLLM answers 400 or 404 for a missing mount too).
    engine.fail_with = AdapterLoadFailed("a", "r0", "rank 64 over --max-lora-rank 16", 400)
    with pytest.raises(AdapterLoadFailed):
        await reg.ensure_loaded(state, "a")
    assert reg.cold_load_ms(state, "b") == normal
    engine.fail_with = AdapterLoadFailed("c", "r0", "No adapter found for /adapters/acme/c", 404)
    with pytest.raises(AdapterLoadFailed):
        await reg.ensure_loaded(state, "c")
    assert reg.cold_load_ms(state, "b") == reg.settings.load_failures.penalty_ms
    engine.fail_with = None
    assert (await reg.ensure_loaded(state, "e", last_resort=True)).loaded_now  # ends it
    assert reg.cold_load_ms(state, "b") == normal
    engine.fail_with = AdapterLoadFailed("a", "r0", "storage not mounted", 500)
    with pytest.raises(AdapterLoadFailed):
        await reg.ensure_loaded(state, "a")
    penalty = reg.settings.load_failures.penalty_ms
    assert reg.cold_load_ms(state, "b") == penalty  # another adapter, the same replica
    assert reg.cold_load_ms(healthy, "b") == normal  # other replicas are not affected
    for _ in range(50):  # traffic that asks for "b" on both replicas
        reg.record_request("b")
    assert {step.replica for step in reg.plan([state, healthy]).steps} == {"r1"}
    # The avoidance ends, and doubles with each failure in a row; a load that works ends it.
    clock.now += reg.settings.load_failures.base_s + 1
    assert reg.cold_load_ms(state, "b") == normal
    with pytest.raises(AdapterLoadFailed):
        await reg.ensure_loaded(state, "a")
    clock.now += reg.settings.load_failures.base_s + 1
    assert reg.cold_load_ms(state, "b") == penalty  # 20 s this time
    engine.fail_with = None
    assert (await reg.ensure_loaded(state, "a", last_resort=True)).loaded_now
    assert reg.cold_load_ms(state, "b") == normal


async def test_loads_queued_behind_one_that_failed_fall_back_at_once(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    # Loads on one replica go one at a time: behind a hung one, each waited out its own load
    # timeout in line (the fourth request 4 x 60 s) and then hung too.
    reg, engine, _ = setup
    state = full(4)
    engine.gate = asyncio.Event()
    engine.fail_with = AdapterLoadFailed("a", "r0", "no answer within 60s")
    tasks = [asyncio.create_task(reg.ensure_loaded(state, name)) for name in ("a", "b", "c")]
    for _ in range(200):
        await asyncio.sleep(0)
    engine.gate.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, AdapterLoadFailed) for o in outcomes)
    assert engine.calls == [("load", "a")]  # b and c never reached the hung engine
    assert "have been failing" in str(outcomes[1])
    # A last resort still goes there, also when it joins a load that failed early.
    engine.fail_with = None
    engine.gate = asyncio.Event()
    first = asyncio.create_task(reg.ensure_loaded(state, "d"))  # not a last resort
    last = asyncio.create_task(reg.ensure_loaded(state, "d", last_resort=True))
    with pytest.raises(AdapterLoadFailed):
        await first
    engine.gate.set()
    assert (await last).loaded_now


async def test_prewarm_loads_an_adapter_only_where_its_base_model_runs(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    """The live adapter review: a hot adapter of one model was pre-warmed onto the replicas of
    another (vLLM refuses such a load, or it holds a slot no request can use), evicting that
    model's own adapters."""
    reg, _engine, _clock = setup
    ours = replica("r0", max_loras=1, max_cpu_loras=2, loaded=("a", "c"))
    theirs = dataclasses.replace(
        replica("r1", max_loras=1, max_cpu_loras=2, loaded=("their-lora",)),
        models=frozenset({"other-model"}),
    )
    for _ in range(50):
        reg.record_request("b")
    steps = reg.plan([ours, theirs]).steps
    assert steps and {step.replica for step in steps} == {"r0"}
    assert "their-lora" not in {step.evict for step in steps}


async def test_a_broken_adapters_failing_requests_make_no_room_for_it(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    """The live adapter review: requests for an adapter whose loads the engine refuses still
    counted as its traffic, so pre-warming evicted adapters in use to make room for it. Until a
    load of it works, it gets no pre-warm demand; and a plan step whose replica started failing
    loads evicts nothing."""
    reg, engine, clock = setup
    state = replica("r0", max_loras=1, max_cpu_loras=2, loaded=("a", "c"))
    for _ in range(50):
        reg.record_request("b")
    assert [s.adapter for s in reg.plan([state]).steps] == ["b"]  # b is hot: it would go in
    engine.fail_with = AdapterLoadFailed("b", "r0", "No adapter found for /adapters/acme/b", 400)
    with pytest.raises(AdapterLoadFailed):
        await reg.ensure_loaded(state, "b")
    assert reg.plan([state]).steps == []  # failing: nothing evicted for it
    clock.now += reg.settings.load_failures.window_s + 1
    assert [s.adapter for s in reg.plan([state]).steps] == ["b"]  # tried again, later
    engine.fail_with = None
    # A plan made before the replica's loads started failing evicts nothing when carried out.
    plan = reg.plan([state])
    assert plan.steps[0].evict is not None
    engine.fail_with = AdapterLoadFailed("x", "r0", "storage not mounted", 503)
    with pytest.raises(AdapterLoadFailed):
        await reg.ensure_loaded(state, "e")
    calls = len(engine.calls)
    report = await reconcile(plan, reg.loader, {state.replica_id: state})
    assert not report.loaded and engine.calls[calls:] == []  # no unload, no load


async def test_one_tenants_broken_adapters_do_not_slow_another_tenants_cold_loads():
    """Two refused adapters of one tenant priced the replica out of every tenant's cold loads:
    one tenant's broken uploads slowed the others' (each of their cold loads there then paid the
    60 s penalty or fell back). They now price out that tenant's adapters only; refusals of two
    tenants' adapters are the replica's, for everyone."""
    clock = Clock()
    engine = FakeEngine()
    policy = make_policy(
        [adapter("a"), adapter("c"), adapter("g", owners=["globex"], source="/adapters/globex/g"),
         adapter("g2", owners=["globex"], source="/adapters/globex/g2"),
         adapter("i", owners=["initech"], source="/adapters/initech/i"),
         adapter("p", owners=[], public=True, source="/adapters/shared/p")]
    )
    reg = AdapterRegistry.in_memory(
        policy, engine, metrics_registry=CollectorRegistry(), clock=clock,
    )
    try:
        state = full(4)
        penalty = reg.settings.load_failures.penalty_ms
        normal = {name: reg.cold_load_ms(state, name) for name in ("g", "i", "p")}
        for name in ("a", "c"):  # acme's two broken adapters
            engine.fail_with = AdapterLoadFailed(name, "r0", f"No adapter found for {name}", 404)
            with pytest.raises(AdapterLoadFailed):
                await reg.ensure_loaded(state, name)
        assert reg.cold_load_ms(state, "a") == penalty  # acme's loads there: priced out
        assert {n: reg.cold_load_ms(state, n) for n in normal} == normal  # the others: not
        assert not reg.loader.loads_failing(state.replica_id, "g")
        assert reg.loader.loads_failing(state.replica_id, "c")
        engine.fail_with = None
        assert (await reg.ensure_loaded(state, "g")).loaded_now  # globex's load goes ahead
        assert reg.cold_load_ms(state, "a") == penalty  # and says nothing of acme's adapters
        # Refusals of two tenants' adapters within the window are the replica's (a missing mount).
        engine.fail_with = AdapterLoadFailed("i", "r0", "No adapter found for i", 404)
        with pytest.raises(AdapterLoadFailed):
            await reg.ensure_loaded(state, "i")
        assert reg.cold_load_ms(state, "p") == normal["p"]  # one refusal since the load worked
        engine.fail_with = AdapterLoadFailed("p", "r0", "No adapter found for p", 404)
        with pytest.raises(AdapterLoadFailed):
            await reg.ensure_loaded(state, "p")
        assert reg.loader.loads_failing(state.replica_id)
        assert reg.cold_load_ms(state, "g2") == penalty  # every tenant's cold loads now
    finally:
        await reg.close()


async def test_two_gateways_loading_different_adapters_keep_the_replica_within_its_limit():
    """The pre-warm review: each gateway serialised only its own loads on a replica, so two
    gateways loading different adapters at once both saw room, and a replica with room for two
    held three, with nothing to bring it back. One load at a time per replica, fleet-wide."""
    clock = Clock()
    engine = FakeEngine()
    store = MemoryPlacementStore(clock)  # one shared store: what Redis is to two gateways
    gateways = [
        AdapterRegistry(POLICY, store, engine, metrics_registry=CollectorRegistry(), clock=clock)
        for _ in range(2)
    ]
    state = full(2)
    try:
        await gateways[0].ensure_loaded(state, "a")
        engine.gate = asyncio.Event()
        tasks = [
            asyncio.create_task(gateway.ensure_loaded(state, name))
            for gateway, name in zip(gateways, ("b", "c"), strict=True)
        ]
        loads = lambda: [call for call in engine.calls if call[0] == "load"]  # noqa: E731
        async with asyncio.timeout(10):  # one of the two gets the replica's room
            while len(loads()) < 2:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the other gateway as far as it gets meanwhile (its polls)
        assert len(loads()) == 2  # it waits for the room, not loading beside the first
        engine.gate.set()
        await asyncio.gather(*tasks)
        assert len(engine.loaded) == 2 and loads()[-1][1] in engine.loaded  # room made
        assert [call[0] for call in engine.calls].count("unload") == 1
    finally:
        for gateway in gateways:
            await gateway.close()


async def _two_gateways(clock: Clock) -> tuple[FakeEngine, list[AdapterRegistry]]:
    engine = FakeEngine()
    store = MemoryPlacementStore(clock)  # one shared store: what Redis is to two gateways
    return engine, [
        AdapterRegistry(POLICY, store, engine, metrics_registry=CollectorRegistry(), clock=clock)
        for _ in range(2)
    ]


async def test_a_load_that_waited_for_the_room_checks_again_whether_it_is_needed():
    """The diff review: a load that waited for the replica's room while another gateway loaded
    the same adapter loaded it again, evicting an adapter in use for nothing."""
    clock = Clock()
    engine, (first, second) = await _two_gateways(clock)
    state = full(2)
    try:
        engine.gate = asyncio.Event()
        holding = asyncio.create_task(first.ensure_loaded(state, "a"))  # holds the room
        await until(lambda: ("load", "a") in engine.calls)
        waiting = asyncio.create_task(second.ensure_loaded(state, "b"))
        await until(lambda: second.loader.lock_contentions > 0)  # it waits for the room
        await second.store.mark_resident(state.replica_id, "b", clock())  # loaded elsewhere
        engine.gate.set()
        await holding
        assert (await waiting).loaded_now is False
        assert ("load", "b") not in engine.calls and "unload" not in {c[0] for c in engine.calls}
    finally:
        for gateway in (first, second):
            await gateway.close()


async def test_a_gateway_with_loads_queued_lets_another_take_the_room_between_them():
    """The diff review: the gateway holding a replica's room handed it straight to its own next
    load while another gateway polled, so one gateway's queue of loads starved another's."""
    clock = Clock()
    engine, (busy, other) = await _two_gateways(clock)
    state = full(4)
    try:
        engine.gate = asyncio.Event()
        queued = [asyncio.create_task(busy.ensure_loaded(state, name)) for name in "abc"]
        await until(lambda: ("load", "a") in engine.calls)
        single = asyncio.create_task(other.ensure_loaded(state, "d"))
        await until(lambda: other.loader.lock_contentions > 0)  # polling for the room
        engine.gate.set()
        async with asyncio.timeout(10):
            await asyncio.gather(*queued, single)
        order = [name for kind, name in engine.calls if kind == "load"]
        assert order.index("d") < order.index("c"), order  # not after the whole queue
    finally:
        for gateway in (busy, other):
            await gateway.close()


async def test_unloading_everywhere_waits_for_the_requests_using_it(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
):
    """The reload review: a reload that removed an adapter unloaded it 50 ms later, from under a
    stream still using it. With ``wait_idle_s`` the unload waits for that request to end."""
    reg, engine, _ = setup
    state = full(4)
    await reg.ensure_loaded(state, "a")
    async with reg.serving(state, "a"):
        unloading = asyncio.create_task(
            reg.unload_everywhere("a", [state], reason="replaced", wait_idle_s=60)
        )
        await asyncio.sleep(0.3)  # several of its polls
        assert ("unload", "a") not in engine.calls and not unloading.done()
    async with asyncio.timeout(10):
        assert await unloading == []
    assert ("unload", "a") in engine.calls and "a" not in engine.loaded


async def test_a_lasting_placement_store_outage_is_logged_once_then_its_end(
    setup: tuple[AdapterRegistry, FakeEngine, Clock],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The re-check review: with Redis down, every refresh (each poll, 2 s) logged a warning."""
    from adapters_registry.placement import PlacementUnavailable

    reg, _, clock = setup
    snapshot = reg.store.snapshot

    async def down(*args: object, **kwargs: object) -> object:
        raise PlacementUnavailable("Connection refused")

    monkeypatch.setattr(reg.store, "snapshot", down)
    with caplog.at_level("WARNING", logger="adapters_registry.registry"):
        for _ in range(5):
            await reg.refresh([full(4)])
            clock.now += 2.0
        degraded = [r for r in caplog.records if "refresh degraded" in r.getMessage()]
        assert len(degraded) == 1
        monkeypatch.setattr(reg.store, "snapshot", snapshot)
        await reg.refresh([full(4)])
    assert any("answers again after 5" in r.getMessage() for r in caplog.records)
