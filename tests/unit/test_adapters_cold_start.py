"""Cold-load estimates for routing, and the thrash guard."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from adapters_registry.cold_start import ColdStartSettings, LoadTimeModel
from adapters_registry.placement import ReplicaPlacement, Residency
from adapters_registry.registry import AdapterRegistry, RegistrySettings
from adapters_registry.thrash import ThrashGuard, ThrashSettings
from routing.contracts import RoutingRequest
from routing.state import ReplicaState
from routing.types import ReplicaId
from tests.unit.test_adapters_fixtures import (
    BASE_MODEL,
    FakeEngine,
    adapter,
    make_policy,
    replica,
)

NOW = 10_000.0


@pytest.mark.parametrize(
    ("loads", "tripped"),
    [
        ([], False),
        ([NOW - 1, NOW - 2], False),
        ([NOW - 1, NOW - 2, NOW - 59], True),
        ([NOW - 1, NOW - 2, NOW - 60], False),  # exactly a window old: out
        ([NOW - 100, NOW - 200, NOW - 300, NOW - 1], False),
    ],
)
def test_thrash_guard_counts_loads_in_window(loads: list[float], tripped: bool) -> None:
    guard = ThrashGuard(ThrashSettings(max_loads=3, window_s=60))
    assert guard.tripped(loads, NOW) is tripped


def test_load_time_model_defaults_then_ewma() -> None:
    model = LoadTimeModel(ColdStartSettings(storage_mb_per_s=100, load_overhead_ms=10,
                                            ewma_alpha=0.5, default_size_mb=50, min_load_ms=0))
    r0, r1 = ReplicaId("r0"), ReplicaId("r1")
    assert model.load_ms("a", r0, 200.0) == pytest.approx(10 + 2000)
    assert model.load_ms("a", r0, None) == pytest.approx(10 + 500)
    model.observe("a", r0, 400.0)
    model.observe("a", r0, 200.0)
    assert model.load_ms("a", r0, 200.0) == pytest.approx(300.0)
    # Another replica falls back to the adapter's average before its own measurement.
    assert model.load_ms("a", r1, 200.0) == pytest.approx(300.0)
    model.observe("a", r1, 100.0)
    assert model.load_ms("a", r1, 200.0) == pytest.approx(100.0)


def test_a_load_is_never_estimated_below_the_floor() -> None:
    # A tiny adapter loads in a few ms, but the load still takes a slot: never a near-tie with
    # a replica that has it resident.
    model = LoadTimeModel(ColdStartSettings(load_overhead_ms=1, min_load_ms=200))
    r0 = ReplicaId("r0")
    assert model.load_ms("tiny", r0, 0.01) == 200.0  # size-based guess: 1 ms
    model.observe("tiny", r0, 3.0)
    assert model.load_ms("tiny", r0, 0.01) == 200.0  # measured: 3 ms
    model.observe("big", r0, 900.0)
    assert model.load_ms("big", r0, None) == 900.0  # above the floor: the measurement


@pytest.mark.parametrize(
    "bad", [{"storage_mb_per_s": 0}, {"ewma_alpha": 0}, {"ewma_alpha": 1.5},
            {"load_overhead_ms": -1}, {"min_load_ms": -1}],
)
def test_cold_start_settings_refuse_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ColdStartSettings(**bad)


async def test_cold_load_ms_by_tier_and_thrash_penalty() -> None:
    policy = make_policy([adapter("a", size_mb=200.0), adapter("b"), adapter("c")])
    settings = RegistrySettings(
        cold_start=ColdStartSettings(storage_mb_per_s=100, h2d_mb_per_s=1000, load_overhead_ms=0),
        thrash=ThrashSettings(max_loads=2, window_s=60, penalty_ms=99_999),
    )
    reg = AdapterRegistry.in_memory(
        policy, FakeEngine(), settings=settings, metrics_registry=CollectorRegistry(),
        clock=lambda: NOW,
    )
    r0 = replica("r0", loaded=["b"], read_at=NOW, max_loras=1, max_cpu_loras=4)
    # Engine says "b" is loaded and nothing else is known: b is in a GPU slot.
    assert reg.cold_load_ms(r0, "b") == 0.0
    assert reg.cold_load_ms(r0, "a") == pytest.approx(2000.0)
    assert reg.cold_load_ms(r0, "c") == pytest.approx(1000.0)  # default size 100 MB
    # The view knows "a" was used more recently than "b": with one GPU slot, b is host-side.
    reg.view.update(ReplicaPlacement(r0.replica_id, {
        "a": Residency(True, changed_at=NOW, last_used=NOW),
        "b": Residency(True, changed_at=NOW - 100, last_used=NOW - 50),
    }))
    assert reg.cold_load_ms(r0, "a") == 0.0
    assert reg.cold_load_ms(r0, "b") == pytest.approx(100.0)  # 100 MB at 1000 MB/s
    # Two loads in the last minute: the guard trips for adapters that need a load.
    reg.view.update(ReplicaPlacement(r0.replica_id, {}, {}, (NOW - 5, NOW - 1)))
    assert reg.cold_load_ms(r0, "c") == 99_999
    assert reg.cold_load_ms(r0, "b") == 0.0  # resident adapters are unaffected

    request = RoutingRequest("q", BASE_MODEL, "c", "acme", "default", 10)
    r1 = replica("r1", loaded=["c"], read_at=NOW, max_loras=1)
    assert reg.estimates_for(request, [r0, r1]) == {"r0": 99_999, "r1": 0.0}
    base = RoutingRequest("q", BASE_MODEL, None, "acme", "default", 10)
    assert reg.estimates_for(base, [r0, r1]) == {}


async def test_engine_host_cache_report_costs_the_copy() -> None:
    policy = make_policy([adapter("a", size_mb=500.0)])
    settings = RegistrySettings(cold_start=ColdStartSettings(h2d_mb_per_s=1000))
    reg = AdapterRegistry.in_memory(
        policy, FakeEngine(), settings=settings, metrics_registry=CollectorRegistry(),
    )
    state = replace(replica("r0", read_at=NOW), cpu_cached_adapters=frozenset({"a"}))
    assert reg.cold_load_ms(state, "a") == pytest.approx(500.0)


async def test_the_gateways_estimates_are_worked_out_when_a_scorer_reads_them() -> None:
    """A pruned decision over a large fleet reads ~30 estimates: the gateway's mapping works out
    only those, each once, and they are the estimates worked out up front."""
    from gateway.adapters import fill_cold_load_estimates
    from gateway.replicas import ReplicaRegistry

    policy = make_policy([adapter("a", size_mb=200.0), adapter("c")])
    reg = AdapterRegistry.in_memory(
        policy, FakeEngine(), metrics_registry=CollectorRegistry(), clock=lambda: NOW
    )
    replicas = ReplicaRegistry()
    for n in range(50):
        replicas.upsert(replica(f"r{n}", loaded=["c"] if n % 5 == 0 else [], read_at=NOW))
    request = RoutingRequest("q", BASE_MODEL, "c", "acme", "default", 10)
    calls: list[str] = []
    estimate = reg.cold_load_ms

    def counted(state: ReplicaState, name: str) -> float:
        calls.append(state.replica_id)
        return estimate(state, name)

    reg.cold_load_ms = counted  # type: ignore[method-assign]
    fill_cold_load_estimates(reg, replicas, request, replicas.routable())
    assert calls == []
    lazy = request.adapter_cold_load_ms
    assert lazy.get(ReplicaId("r5")) == 0.0 and lazy.get(ReplicaId("r6")) > 0
    assert lazy.get(ReplicaId("r5")) == 0.0  # read twice, worked out once
    assert calls == ["r5", "r6"]
    assert lazy.get(ReplicaId("nobody")) is None
    eager = reg.estimates_for(
        request, [replicas.adapter_view(state) for state in replicas.routable()]
    )
    assert dict(lazy) == eager and len(lazy) == 50
