"""The fleet view (routing/fleet.py): arrays that match the states they mirror, the same pruning
as a plain list of states, and the gateway registry keeping one in step with its replicas."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.replicas import ReplicaRegistry
from routing.contracts import RoutingRequest
from routing.fleet import Fleet
from routing.prune import Pruning, prune
from routing.state import ReplicaState
from routing.types import ReplicaId


def state(i: int, **figures: object) -> ReplicaState:
    figures.setdefault("models", frozenset({"m"}))
    return ReplicaState(ReplicaId(f"r{i}"), f"http://r{i}", **figures)  # type: ignore[arg-type]


def test_columns_follow_replaced_states_and_masks_follow_health_models_and_adapters() -> None:
    fleet = Fleet([state(i, running=i, waiting=2 * i, inflight_requests=3 * i) for i in range(5)])
    assert fleet.running.tolist() == [0, 1, 2, 3, 4]
    assert fleet.waiting.tolist() == [0, 2, 4, 6, 8]
    assert fleet.inflight.tolist() == [0, 3, 6, 9, 12]
    assert fleet.serving("m").all() and not fleet.serving("other").any()
    assert fleet.adapter_residence("a").tolist() == [0] * 5

    assert fleet.put(replace(fleet[2], running=7, healthy=False, loaded_adapters=frozenset({"a"})))
    assert fleet.running.tolist() == [0, 1, 7, 3, 4]
    assert fleet.serving("m").tolist() == [True, True, False, True, True]
    assert fleet.adapter_residence("a").tolist() == [0, 0, 2, 0, 0]
    assert fleet.put(replace(fleet[4], cpu_cached_adapters=frozenset({"a"}), models=frozenset()))
    assert fleet.adapter_residence("a").tolist() == [0, 0, 2, 0, 1]
    assert fleet.serving("m").tolist() == [True, True, False, True, False]

    assert not fleet.put(state(9, running=1))  # not a member: nothing changes
    assert len(fleet) == 5 and fleet.position(ReplicaId("r9")) is None
    with pytest.raises(ValueError, match="once"):
        Fleet([state(1), state(1)])
    with pytest.raises(ValueError):
        fleet.running[0] = 5  # read-only: only ``put`` changes a fleet


def test_a_copy_with_other_states_leaves_the_fleet_as_it_was() -> None:
    fleet = Fleet([state(i, running=i) for i in range(4)])
    fleet.serving("m")  # a cached mask the copy must not share once it changes
    copy = fleet.with_states([replace(fleet[1], healthy=False, running=9)])
    assert copy.serving("m").tolist() == [True, False, True, True]
    assert copy.running.tolist() == [0, 9, 2, 3]
    assert fleet.serving("m").all() and fleet.running.tolist() == [0, 1, 2, 3]
    assert fleet[1].healthy and not copy[1].healthy
    with pytest.raises(KeyError, match="r7"):
        fleet.with_states([state(7)])


fleets = st.lists(
    st.tuples(
        st.integers(0, 30),  # running
        st.integers(0, 8),  # waiting
        st.integers(0, 30),  # in flight
        st.booleans(),  # healthy
        st.sampled_from(["m", "m", "m", "other"]),  # model
        st.sampled_from([0, 0, 1, 2]),  # adapter: absent, host, GPU
        st.sampled_from([0, 0, 0, 3, 9]),  # prefix blocks held
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=80, deadline=None)
@given(fleets, st.booleans(), st.integers(0, 2**16))
def test_pruning_a_fleet_is_pruning_its_states(rows, adapter_request, seed) -> None:  # type: ignore[no-untyped-def]
    """The arrays are the figures the pass would read: same scored set, summary, loads and
    removals, whatever mix of health, models, adapters and prefix depths."""
    states = [
        state(
            i,
            running=r,
            waiting=w,
            inflight_requests=f,
            healthy=healthy,
            models=frozenset({model}),
            loaded_adapters=frozenset({"a"}) if where == 2 else frozenset(),
            cpu_cached_adapters=frozenset({"a"}) if where == 1 else frozenset(),
        )
        for i, (r, w, f, healthy, model, where, _) in enumerate(rows)
    ]
    matches = {s.replica_id: row[6] for s, row in zip(states, rows, strict=True) if row[6]}
    request = RoutingRequest(
        request_id="q",
        model="m",
        adapter="a" if adapter_request else None,
        tenant="t",
        route="d",
        prompt_tokens=160,
        block_size=16,
        prefix_matches=matches,
    )
    pruning = Pruning(above=8, least_loaded=3)
    from_list = prune(request, states, pruning, np.random.default_rng(seed), serves="m")
    from_fleet = prune(request, Fleet(states), pruning, np.random.default_rng(seed), serves="m")
    assert [r.replica_id for r in from_fleet.scored] == [r.replica_id for r in from_list.scored]
    assert from_fleet.summary == from_list.summary
    expected_loads = {s.replica_id: float(s.load) for s in states}
    assert dict(from_fleet.loads) == dict(from_list.loads) == expected_loads
    assert from_fleet.removed == from_list.removed
    assert from_fleet.count == from_list.count


def test_the_registry_hands_out_one_fleet_kept_in_step_with_its_replicas() -> None:
    now = [0.0]
    registry = ReplicaRegistry(failure_threshold=2, cooldown_s=10.0, clock=lambda: now[0])
    for i in range(3):
        registry.upsert(state(i))
    fleet = registry.routable()
    assert isinstance(fleet, Fleet) and [s.replica_id for s in fleet] == ["r0", "r1", "r2"]
    assert registry.routable() is fleet  # nothing changed: no copy, no rebuild

    registry.set_inflight({ReplicaId("r1"): (4, 900)})
    assert registry.routable() is fleet
    assert fleet.inflight.tolist() == [0, 4, 0] and fleet[1].inflight_prefill_tokens == 900

    # A breaker that holds requests back: a copy marks that replica unhealthy; the fleet itself
    # stays as the registry knows it.
    breaker = registry.breaker(ReplicaId("r2"))
    breaker.failure()
    assert registry.routable() is fleet  # one failure does not open it
    breaker.failure()
    held = registry.routable()
    assert held is not fleet and not held[2].healthy and fleet[2].healthy
    assert held.serving("m").tolist() == [True, True, False]
    breaker.success()
    assert registry.routable() is fleet

    registry.upsert(state(3))  # a new replica: a new fleet with it
    grown = registry.routable()
    assert grown is not fleet and [s.replica_id for s in grown] == ["r0", "r1", "r2", "r3"]
    assert grown.inflight.tolist() == [0, 4, 0, 0]
    registry.remove(ReplicaId("r0"))
    assert [s.replica_id for s in registry.routable()] == ["r1", "r2", "r3"]

    # A request still in flight to a removed replica fails afterwards: its breaker (held by the
    # request) opens, and routing must not trip over a replica it no longer knows.
    gone = registry.breaker(ReplicaId("r3"))
    registry.remove(ReplicaId("r3"))
    gone.failure()
    gone.failure()
    assert [s.replica_id for s in registry.routable()] == ["r1", "r2"]


operations = st.lists(
    st.tuples(
        st.sampled_from(["start", "prefilled", "finish", "reading", "route"]),
        st.integers(0, 4),  # replica
        st.integers(0, 300),  # tokens, or the reading's running gauge
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(operations)
# A reading taken between a request's send and its end: it still counts it.
@example([("start", 0, 0), ("start", 0, 0), ("finish", 0, 0), ("reading", 0, 1)])
def test_refreshing_what_changed_gives_the_figures_of_a_full_refresh(ops) -> None:  # type: ignore[no-untyped-def]
    """The request path looks only at replicas that moved; a twin registry refreshed in full
    after every step has the same states, and both fleets have the same arrays."""
    from gateway.inflight import MemoryInflight

    clock = [100.0]
    inflight = MemoryInflight(lambda: clock[0])
    incremental, full = ReplicaRegistry(), ReplicaRegistry()
    for registry in (incremental, full):
        for i in range(5):
            registry.upsert(state(i, running=1, metrics_read_at=100.0))
    sent: dict[int, list[float]] = {i: [] for i in range(5)}
    for op, i, value in ops:
        clock[0] += 0.25
        rid = ReplicaId(f"r{i}")
        if op == "start":
            inflight.start(rid, value)
            sent[i].append(clock[0])
        elif op == "prefilled":
            inflight.prefilled(rid, value)
        elif op == "finish" and sent[i]:
            inflight.finish(rid, 0, started_at=sent[i].pop(0))
        elif op == "reading":
            for registry in (incremental, full):
                current = registry.get(rid)
                assert current is not None
                # Read a while ago (as an agent's merged scrape arrives): requests sent before
                # it may have ended since, and come off its gauge.
                read_at = clock[0] - (value % 5) * 0.25 - 0.1
                registry.sync_discovered(
                    [replace(current, running=value % 7, metrics_read_at=read_at)]
                )
        incremental.refresh_inflight(inflight)
        full.set_inflight(inflight.counts(), inflight.ended_since, inflight.awaiting_prefill)
        assert incremental.all() == full.all()
        fleet, twin = incremental.routable(), full.routable()
        assert fleet.inflight.tolist() == twin.inflight.tolist()
        assert fleet.running.tolist() == twin.running.tolist()
        assert fleet.inflight.tolist() == [s.inflight_requests for s in incremental.all()]
