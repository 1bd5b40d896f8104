"""The pre-warm planner (pure, table-driven) and its traffic window."""

from __future__ import annotations

import pytest

from adapters_registry.prewarm import (
    AdapterDemand,
    PlanStep,
    PrewarmSettings,
    ReplicaSlots,
    TrafficWindow,
    desired_replicas,
    plan_replication,
)
from routing.types import ReplicaId

FILL_ALL = PrewarmSettings(fill_fraction=1.0)


def demands(**requests: int) -> list[AdapterDemand]:
    return [AdapterDemand(name, n) for name, n in requests.items()]


@pytest.mark.parametrize(
    ("demand", "n_replicas", "slots", "expected"),
    [
        # Proportional to share of traffic: 6 slots, 50/30/20 % -> 3/2/1.
        (demands(hot=50, warm=30, cold=20), 4, 6, {"hot": 3, "warm": 2, "cold": 1}),
        # Bounded by replicas: one adapter cannot be on more replicas than exist.
        (demands(only=100), 3, 12, {"only": 3}),
        # Idle adapters get nothing; a trickle still gets one replica.
        (demands(hot=990, trickle=1, idle=0), 4, 8, {"hot": 4, "trickle": 1, "idle": 0}),
        # Over budget: the most replicated give up replicas first, never below 1.
        (demands(a=40, b=30, c=20, d=10), 2, 4, {"a": 1, "b": 1, "c": 1, "d": 1}),
        (demands(a=70, b=10, c=10, d=10), 4, 5, {"a": 2, "b": 1, "c": 1, "d": 1}),
        # Unknown slot counts: no budget trimming.
        (demands(a=50, b=50), 2, None, {"a": 2, "b": 2}),
        # No replicas: nothing anywhere.
        (demands(a=5), 0, 0, {"a": 0}),
    ],
)
def test_desired_replicas(
    demand: list[AdapterDemand], n_replicas: int, slots: int | None, expected: dict[str, int]
) -> None:
    assert desired_replicas(demand, n_replicas, slots, FILL_ALL) == expected


def test_prewarm_replicas_is_a_floor_even_without_traffic() -> None:
    demand = [
        AdapterDemand("pinned", 0, pinned=True, prewarm_replicas=2),
        AdapterDemand("big-floor", 0, prewarm_replicas=9),
        AdapterDemand("hot", 100),
    ]
    # 3 replicas x 1 slot: floors (2 + 3) exceed the budget and are kept; hot keeps 1.
    assert desired_replicas(demand, 3, 3, FILL_ALL) == {"pinned": 2, "big-floor": 3, "hot": 1}


def test_fill_fraction_leaves_room_for_on_demand_loads() -> None:
    settings = PrewarmSettings(fill_fraction=0.5)
    assert desired_replicas(demands(a=50, b=50), 4, 8, settings) == {"a": 2, "b": 2}


def slots(
    rid: str, capacity: int | None, *resident: str, busy: tuple[str, ...] = ()
) -> ReplicaSlots:
    return ReplicaSlots(ReplicaId(rid), capacity, frozenset(resident), frozenset(busy))


def test_plan_fills_free_slots_emptiest_first() -> None:
    plan = plan_replication(
        demands(hot=60, cold=40),
        [slots("r0", 2, "cold"), slots("r1", 2), slots("r2", 2, "x")],
        FILL_ALL,
    )
    # 6 slots: hot 60 % -> 4, capped at 3 replicas; cold 40 % -> 2. "x" has no traffic but
    # stays: a free slot was available everywhere a load went.
    assert plan.desired == {"hot": 3, "cold": 2}
    assert plan.steps == [
        PlanStep(ReplicaId("r1"), "hot"),
        PlanStep(ReplicaId("r0"), "hot"),
        PlanStep(ReplicaId("r2"), "hot"),
        PlanStep(ReplicaId("r1"), "cold"),
    ]


def test_plan_evicts_only_over_replicated_unpinned_idle_adapters() -> None:
    demand = [
        AdapterDemand("hot", 100),
        AdapterDemand("pin", 0, pinned=True),
        AdapterDemand("idle", 0),
        AdapterDemand("busy", 0),
    ]
    replicas = [
        slots("r0", 1, "pin"),
        slots("r1", 1, "busy", busy=("busy",)),
        slots("r2", 1, "idle"),
    ]
    plan = plan_replication(demand, replicas, PrewarmSettings(fill_fraction=1.0))
    assert plan.desired["hot"] == 3
    assert plan.steps == [PlanStep(ReplicaId("r2"), "hot", evict="idle")]


def test_plan_is_a_no_op_when_placement_already_matches() -> None:
    plan = plan_replication(
        demands(a=50, b=50), [slots("r0", 1, "a"), slots("r1", 1, "b")], FILL_ALL
    )
    assert plan.desired == {"a": 1, "b": 1}
    assert plan.steps == []


def test_traffic_window_slides() -> None:
    window = TrafficWindow(PrewarmSettings(window_s=60, buckets=6))
    window.record("a", now=0.0)
    window.record("a", now=15.0, n=2)
    window.record("b", now=55.0)
    assert window.counts(now=59.0) == {"a": 3, "b": 1}
    assert window.counts(now=65.0) == {"a": 2, "b": 1}  # the 0-10 s bucket left the window
    assert window.counts(now=200.0) == {}


@pytest.mark.parametrize(
    "bad", [{"window_s": 0}, {"buckets": 0}, {"fill_fraction": 0}, {"fill_fraction": 1.5},
            {"min_requests": 0}],
)
def test_prewarm_settings_refuse_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PrewarmSettings(**bad)  # type: ignore[arg-type]
