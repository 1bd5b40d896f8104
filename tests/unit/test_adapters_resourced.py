"""A reload that gives an adapter name other weights (a new ``source``, perhaps a new owner).

vLLM loads by name and answers a second load of a loaded name "already loaded", so a replica
holding the old weights would go on serving them under the name. The live LoRA-reload review
found two ways that happened: a load under way when the reload came finished with the old weights
and was never unloaded, and requests admitted under the new policy (by the new owner, too) were
served by the old copy while the old owner's streams ran. The registry records which source each
copy was loaded from, and a request is served only by a copy of the weights it was admitted for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from adapters_registry.errors import OldWeightsInUse
from adapters_registry.loader import UNKNOWN_WEIGHTS
from adapters_registry.registry import AdapterRegistry
from routing.config import Policy
from routing.state import ReplicaState
from tests.unit.test_adapters_fixtures import FakeEngine, adapter, make_policy, replica

OLD = "/adapters/acme/shared"
NEW = "/adapters/globex/shared"


def policy(source: str, owners: list[str]) -> Policy:
    return make_policy([adapter("shared", source=source, owners=owners)])


@pytest.fixture
async def reg_engine() -> AsyncIterator[tuple[AdapterRegistry, FakeEngine]]:
    engine = FakeEngine()
    reg = AdapterRegistry.in_memory(
        policy(OLD, ["acme"]), engine, metrics_registry=CollectorRegistry()
    )
    yield reg, engine
    await reg.close()


def r0() -> ReplicaState:
    return replica("r0", max_loras=1, max_cpu_loras=4)


async def test_a_request_after_the_reload_is_never_served_by_the_old_weights(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    reg, engine = reg_engine
    old_stream = reg.serving(r0(), "shared")
    await old_stream.__aenter__()  # acme's stream, admitted before the reload, still running
    assert engine.paths == {"shared": OLD}

    assert reg.update_policy(policy(NEW, ["globex"])) == ["shared"]
    # To routing the old copy is a load away, not resident.
    assert reg.cold_load_ms(r0(), "shared") > 0
    # The new owner's request cannot load its weights there while acme's stream uses the old
    # ones: it is told to try another replica (503 no_adapter_slot if none), not served them.
    with pytest.raises(OldWeightsInUse):
        async with reg.serving(r0(), "shared"):
            pass
    assert engine.paths == {"shared": OLD}

    await old_stream.__aexit__(None, None, None)
    async with reg.serving(r0(), "shared") as result:
        assert result.loaded_now
    assert engine.paths == {"shared": NEW}
    assert engine.calls[-2:] == [("unload", "shared"), ("load", "shared")]
    assert reg.cold_load_ms(r0(), "shared") == 0.0


async def test_a_load_under_way_at_the_reload_is_unloaded_when_its_requests_end(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    reg, engine = reg_engine
    engine.gate = asyncio.Event()
    old_request = asyncio.create_task(_serve_once(reg, r0()))
    for _ in range(1000):  # until the engine call is under way
        if engine.calls:
            break
        await asyncio.sleep(0)
    assert engine.calls == [("load", "shared")] and not engine.loaded

    # The reload: nothing lists the adapter as resident yet, but the load's lock is held.
    assert reg.update_policy(policy(NEW, ["acme"])) == ["shared"]
    # The load under way is of the old weights: for the new ones the replica is a full load.
    full_load = reg.load_times.load_ms("shared", r0().replica_id, None)
    assert reg.cold_load_ms(r0(), "shared") == full_load
    unloading = asyncio.create_task(
        reg.unload_everywhere("shared", [r0()], reason="replaced", wait_idle_s=60,
                              only_replaced=True)
    )
    await asyncio.sleep(0.1)
    assert not unloading.done()
    engine.gate.set()  # the load finishes, with the weights it began with
    async with asyncio.timeout(10):
        await old_request  # served, as admitted, by the old weights
        assert await unloading == []
    assert "shared" not in engine.loaded and ("unload", "shared") in engine.calls


async def test_the_reloads_unload_keeps_new_weights_a_request_loaded_meanwhile(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    reg, engine = reg_engine
    await reg.ensure_loaded(r0(), "shared")
    reg.update_policy(policy(NEW, ["acme"]))
    await reg.ensure_loaded(r0(), "shared")  # the old copy was idle: replaced at once
    assert engine.paths == {"shared": NEW}
    calls = len(engine.calls)
    assert await reg.unload_everywhere(
        "shared", [r0()], reason="replaced", only_replaced=True
    ) == []
    assert engine.paths == {"shared": NEW} and len(engine.calls) == calls


async def _serve_once(reg: AdapterRegistry, state: ReplicaState) -> None:
    async with reg.serving(state, "shared"):
        await asyncio.sleep(0.05)


def _counts(reg: AdapterRegistry, metric: str) -> dict[str, float]:
    """Samples of ``metric`` summed by adapter label."""
    out: dict[str, float] = {}
    for family in getattr(reg.metrics, metric).collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                label = sample.labels["adapter"]
                out[label] = out.get(label, 0.0) + sample.value
    return out


async def test_loads_and_unloads_of_one_set_of_weights_add_up_under_one_label(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    reg, _ = reg_engine
    await reg.ensure_loaded(r0(), "shared")
    old_label = reg.catalog.metrics_label("shared")
    assert old_label.startswith("private-")
    reg.update_policy(policy(NEW, ["globex"]))
    new_label = reg.catalog.metrics_label("shared")
    await reg.ensure_loaded(r0(), "shared")  # drops the idle old weights, loads the new
    assert new_label != old_label
    assert _counts(reg, "loads") == {old_label: 1.0, new_label: 1.0}
    assert _counts(reg, "unloads") == {old_label: 1.0}


async def test_a_removed_public_adapter_keeps_its_name_as_label() -> None:
    engine = FakeEngine()
    reg = AdapterRegistry.in_memory(
        make_policy([adapter("pub", owners=[], public=True)]), engine,
        metrics_registry=CollectorRegistry(),
    )
    try:
        await reg.ensure_loaded(r0(), "pub")
        assert reg.update_policy(make_policy([])) == ["pub"]
        assert await reg.unload_everywhere("pub", [r0()], reason="replaced") == []
        assert _counts(reg, "loads") == {"pub": 1.0}
        assert _counts(reg, "unloads") == {"pub": 1.0}
    finally:
        await reg.close()


async def test_a_lowered_resident_limit_is_reached_by_unloading_idle_adapters() -> None:
    """The LoRA-reload review: after a reload lowered ``max_cpu_loras`` from 3 to 1 a replica
    kept 3 adapters for as long as it was watched (loads only make room for one more)."""
    engine = FakeEngine()
    names = ["a", "b", "c"]
    reg = AdapterRegistry.in_memory(
        make_policy([adapter(n) for n in names], max_loras=1, max_cpu_loras=3), engine,
        metrics_registry=CollectorRegistry(),
    )
    state = replica("r0")  # the engine reports no slot counts: the pool's are used
    try:
        for name in names:
            await reg.ensure_loaded(state, name)
        await reg.refresh([state])
        assert engine.loaded == set(names)  # within the limit: nothing goes
        reg.update_policy(make_policy([adapter(n) for n in names], max_loras=1, max_cpu_loras=1))
        await reg.refresh([state], trim=False)  # a read (GET /admin/adapters) unloads nothing
        await reg.trims_finished()
        assert engine.loaded == set(names)
        async with reg.serving(state, "a"):  # in use, though least recently loaded: it stays
            await reg.refresh([state])
            await reg.trims_finished()
            await reg.refresh([state], trim=False)
            assert engine.loaded == {"a"}
            assert reg.view.get(state.replica_id).resident == {"a"}
        assert _counts(reg, "unloads") == {
            reg.catalog.metrics_label("b"): 1.0, reg.catalog.metrics_label("c"): 1.0
        }
    finally:
        await reg.close()


async def test_a_load_under_way_makes_its_replica_the_cheap_one_for_the_next_request(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    """Simultaneous first requests for a cold adapter each saw a full load everywhere, went to
    different replicas and loaded it twice (the LoRA-reload review): the replica where this
    gateway is loading it costs only what is left of that load."""
    reg, engine = reg_engine
    engine.gate = asyncio.Event()
    r1 = replica("r1", max_loras=1, max_cpu_loras=4)
    full_load = reg.cold_load_ms(r0(), "shared")
    assert reg.cold_load_ms(r1, "shared") == full_load
    first = asyncio.create_task(_serve_once(reg, r0()))
    for _ in range(1000):
        if engine.calls:
            break
        await asyncio.sleep(0)
    assert 0 < reg.cold_load_ms(r0(), "shared") < full_load == reg.cold_load_ms(r1, "shared")
    engine.gate.set()
    await first
    assert reg.cold_load_ms(r0(), "shared") == 0.0


async def test_a_request_after_the_reload_does_not_share_a_load_of_the_old_weights(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    """The fix's live re-check: a request that came, on the same gateway, while the old weights
    were still loading joined that load and was served them."""
    reg, engine = reg_engine
    engine.gate = asyncio.Event()
    hold = asyncio.Event()

    async def old_stream() -> None:
        async with reg.serving(r0(), "shared"):
            await hold.wait()

    old = asyncio.create_task(old_stream())
    for _ in range(1000):
        if engine.calls:
            break
        await asyncio.sleep(0)
    reg.update_policy(policy(NEW, ["globex"]))
    new = asyncio.create_task(_serve_once(reg, r0()))
    await asyncio.sleep(0.05)
    engine.gate.set()  # the old weights' load ends; the old stream runs on
    with pytest.raises(OldWeightsInUse):
        await asyncio.wait_for(new, 10)
    assert engine.paths == {"shared": OLD}
    hold.set()
    await old


async def test_trimming_leaves_adapters_no_gateway_can_load_again() -> None:
    engine = FakeEngine()
    reg = AdapterRegistry.in_memory(
        make_policy([adapter("a")], max_loras=1, max_cpu_loras=1), engine,
        metrics_registry=CollectorRegistry(),
    )
    # The engine was started with a LoRA module of its own (vLLM --lora-modules).
    state = replica("r0", loaded=("static",), read_at=reg._clock())
    try:
        await reg.ensure_loaded(state, "a")
        await reg.refresh([state])
        await reg.trims_finished()
        await reg.refresh([state], trim=False)
        # Two resident against a limit of one: "a" goes, "static" stays.
        assert reg.view.get(state.replica_id).resident == {"static"}
        assert engine.calls == [("load", "a"), ("unload", "a")]
    finally:
        await reg.close()


async def test_a_copy_whose_weights_nobody_recorded_is_not_served_after_a_re_source(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    """The diff review: a copy first seen in an engine report (or written by the previous
    release, or recorded in a Redis since restarted) counted as the catalog's weights, after a
    re-source the new ones, and the new owner was served the old."""
    reg, engine = reg_engine
    engine.loaded.add("shared")
    engine.paths["shared"] = OLD
    seen = replica("r0", loaded=("shared",), read_at=reg._clock(), max_loras=1, max_cpu_loras=4)
    await reg.refresh([seen])
    assert (await reg.store.status(seen.replica_id, "shared")).source is None
    old_stream = reg.serving(seen, "shared")
    await old_stream.__aenter__()  # admitted before the reload, on the unrecorded copy

    reg.update_policy(policy(NEW, ["globex"]))
    unloading = asyncio.create_task(
        reg.unload_everywhere("shared", [seen], reason="replaced", wait_idle_s=60,
                              only_replaced=True)
    )
    for _ in range(1000):
        if (await reg.store.status(seen.replica_id, "shared")).source is not None:
            break
        await asyncio.sleep(0)
    with pytest.raises(OldWeightsInUse):
        async with reg.serving(seen, "shared"):
            pass
    assert not unloading.done() and engine.paths == {"shared": OLD}
    await old_stream.__aexit__(None, None, None)
    async with asyncio.timeout(10):
        assert await unloading == []
    async with reg.serving(seen, "shared"):
        assert engine.paths == {"shared": NEW}


async def test_right_after_the_reload_an_unrecorded_copy_serves_no_new_request(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    """The mends review: until the reload's background task marked an unrecorded copy, a
    request admitted after the reload was served by it (the old weights)."""
    reg, engine = reg_engine
    engine.loaded.add("shared")
    engine.paths["shared"] = OLD
    seen = replica("r0", loaded=("shared",), read_at=reg._clock(), max_loras=1, max_cpu_loras=4)
    await reg.refresh([seen])
    old_stream = reg.serving(seen, "shared")
    await old_stream.__aenter__()
    reg.update_policy(policy(NEW, ["globex"]))  # no unload_everywhere has run yet
    assert reg.cold_load_ms(seen, "shared") > 0
    with pytest.raises(OldWeightsInUse):
        async with reg.serving(seen, "shared"):
            pass
    await old_stream.__aexit__(None, None, None)


async def test_an_unload_waiting_on_a_copy_marked_unknown_already_does_not_spin(
    reg_engine: tuple[AdapterRegistry, FakeEngine],
) -> None:
    """The mends review: with the copy marked by an earlier reload (or another gateway), the
    wait counted only old-source requests and the unload all of them: ~6.8M unload calls in
    0.5 s, for up to 5 minutes."""
    reg, engine = reg_engine
    engine.loaded.add("shared")
    seen = replica("r0", loaded=("shared",), read_at=reg._clock(), max_loras=1, max_cpu_loras=4)
    await reg.refresh([seen])
    await reg.store.mark_resident(seen.replica_id, "shared", reg._clock(), UNKNOWN_WEIGHTS)
    reg.update_policy(policy(NEW, ["globex"]))
    async with reg.loader.in_use(seen.replica_id, "shared"):  # admitted for the new weights
        calls = 0
        real_unload = reg.loader.unload

        async def counted(*args: object, **kwargs: object) -> bool:
            nonlocal calls
            calls += 1
            return await real_unload(*args, **kwargs)  # type: ignore[arg-type]

        reg.loader.unload = counted  # type: ignore[method-assign]
        unloading = asyncio.create_task(
            reg.unload_everywhere("shared", [seen], reason="replaced", wait_idle_s=60,
                                  only_replaced=True)
        )
        await asyncio.sleep(0.3)
        assert not unloading.done() and calls <= 2
    async with asyncio.timeout(10):
        assert await unloading == []
    assert "shared" not in engine.loaded
