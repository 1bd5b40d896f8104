"""Flow control's pure core on a fake clock: ordering, fair shares, bounded waits, shedding."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest

from routing.contracts import ReplicaExplanation, RoutingDecision
from routing.flow_control import (
    Decision,
    FairQueue,
    FleetEstimate,
    FlowController,
    FlowControlSettings,
    FlowRequest,
    MemoryBudgetStore,
    RequestClass,
    ShedReason,
    TokenBudget,
    TokenBudgets,
    estimate_from_decision,
    parse_request_class,
)
from routing.flow_control.controller import ITL_BOUND_STEP
from routing.flow_control.estimate import ReplicaLoad
from routing.state import ReplicaState
from routing.types import ReplicaId

CRITICAL, STANDARD, SHEDDABLE = RequestClass.CRITICAL, RequestClass.STANDARD, RequestClass.SHEDDABLE


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(
    rid: str,
    request_class: RequestClass = STANDARD,
    tenant: str = "a",
    weight: float = 1.0,
    slo_ms: float = 2000.0,
    at: float = 100.0,
) -> FlowRequest:
    return FlowRequest(rid, tenant, request_class, slo_ms, weight, at)


def _fleet(
    wait_ms: float,
    ttft_ms: float | None = None,
    interference_ms: float = 0.0,
    backlog: int | None = 0,
    kv_usage: float | None = 0.5,
) -> FleetEstimate:
    """Two replicas, both at ``wait_ms`` predicted queue wait and ``backlog`` requests waiting."""
    load = ReplicaLoad(wait_ms, interference_ms, backlog, kv_usage)
    return FleetEstimate(wait_ms + 100.0 if ttft_ms is None else ttft_ms, (load, load))


IDLE = _fleet(0.0)
BUSY = _fleet(5000.0, ttft_ms=1500.0, backlog=5)


def _controller(clock: FakeClock, **settings: object) -> FlowController:
    return FlowController(FlowControlSettings(**settings), clock)  # type: ignore[arg-type]


def test_class_names_parse_case_insensitively_and_bad_ones_say_what_is_accepted() -> None:
    assert parse_request_class(" Critical ") is CRITICAL
    with pytest.raises(ValueError, match="critical, standard, sheddable"):
        parse_request_class("urgent")


def test_below_saturation_everything_is_admitted_at_once() -> None:
    flow = _controller(FakeClock())
    assert flow.admit(_request("s", STANDARD), IDLE).reason == "not_saturated"
    assert flow.admit(_request("x", SHEDDABLE), IDLE).reason == "not_saturated"
    assert flow.admit(_request("c", CRITICAL), IDLE).decision is Decision.ADMIT
    assert len(flow.queue) == 0


def test_saturated_means_every_engine_has_requests_waiting_or_its_kv_cache_nearly_full() -> None:
    flow = _controller(FakeClock())  # defaults: 2 waiting, or KV usage 0.92

    def fleet(second: ReplicaLoad) -> FleetEstimate:
        return FleetEstimate(200.0, (ReplicaLoad(5000.0, 0.0, 7, 0.99), second))

    admitted = [
        ReplicaLoad(10.0, 0.0, 1, 0.5),  # one request waiting: a step boundary away
        ReplicaLoad(10.0, 0.0, 0, 0.91),
        # The model predicts a long wait, but the engine has nothing waiting: room.
        ReplicaLoad(9000.0, 900.0, 0, 0.5),
        ReplicaLoad(9000.0, 0.0, None, None),  # engine figures unknown: never full by them
    ]
    for i, second in enumerate(admitted):
        verdict = flow.admit(_request(f"a{i}", SHEDDABLE, slo_ms=100.0), fleet(second))
        assert verdict.reason == "not_saturated", second
    queued = [ReplicaLoad(10.0, 0.0, 2, 0.5), ReplicaLoad(10.0, 0.0, 0, 0.92)]
    for i, second in enumerate(queued):
        verdict = flow.admit(_request(f"q{i}", slo_ms=60_000.0), fleet(second))
        assert verdict.decision is Decision.QUEUE, second
    assert len(flow.queue) == 2
    no_candidates = FleetEstimate(200.0, ())
    assert _controller(FakeClock()).admit(_request("n"), no_candidates).decision is Decision.ADMIT


def test_optional_bounds_on_queue_wait_or_decode_interference_also_make_a_replica_full() -> None:
    flow = _controller(
        FakeClock(), saturation_queue_wait_ms=30.0, saturation_decode_interference_ms=50.0
    )
    one_free = FleetEstimate(200.0, (ReplicaLoad(5000.0, 0.0, 0), ReplicaLoad(10.0, 10.0, 0)))
    assert flow.admit(_request("a"), one_free).decision is Decision.ADMIT
    # The short queue is behind a replica whose decodes already pay for heavy prefill.
    hot = FleetEstimate(200.0, (ReplicaLoad(5000.0, 0.0, 0), ReplicaLoad(10.0, 80.0, 0)))
    assert flow.admit(_request("b"), hot).decision is Decision.QUEUE


def test_a_replica_whose_decodes_run_slower_than_the_tpot_slo_allows_is_full() -> None:
    flow = _controller(FakeClock(), saturation_itl_fraction=0.8)

    def fleet(itl_ms: float | None) -> FleetEstimate:
        # Nothing waits anywhere: only the decodes' pace can make these replicas full.
        return FleetEstimate(
            200.0, (ReplicaLoad(10.0, 0.0, 0, 0.5, 45.0), ReplicaLoad(10.0, 0.0, 0, 0.5, itl_ms))
        )

    def request(rid: str, tpot_slo_ms: float | None) -> FlowRequest:
        return FlowRequest(rid, "a", STANDARD, 60_000.0, 1.0, 100.0, tpot_slo_ms)

    # 45 ms between tokens against a 50 ms SLO is over 0.8 x: full. The other replica decides.
    assert flow.admit(request("fast", 50.0), fleet(30.0)).reason == "not_saturated"
    assert flow.admit(request("idle", 50.0), fleet(None)).reason == "not_saturated"
    assert flow.admit(request("slow", 50.0), fleet(41.0)).decision is Decision.QUEUE
    # A request without a TPOT objective is not judged by it; a looser one finds room.
    other = _controller(FakeClock(), saturation_itl_fraction=0.8)
    assert other.admit(request("none", None), fleet(41.0)).reason == "not_saturated"
    assert other.admit(request("loose", 100.0), fleet(41.0)).reason == "not_saturated"
    with pytest.raises(ValueError, match="saturation_itl_fraction"):
        FlowControlSettings(saturation_itl_fraction=0.0)


def test_tpot_misses_tighten_the_inter_token_bound_and_met_ones_relax_it() -> None:
    flow = _controller(FakeClock(), saturation_itl_fraction=0.8, tpot_target=0.97)
    assert flow.itl_fraction == pytest.approx(0.8)

    def fleet() -> FleetEstimate:
        # Both replicas decode 36 ms apart, nothing waits: 0.72 of a 50 ms SLO.
        load = ReplicaLoad(10.0, 0.0, 0, 0.5, 36.0)
        return FleetEstimate(200.0, (load, load), chosen_decode_itl_ms=36.0)

    def request(rid: str) -> FlowRequest:
        return FlowRequest(rid, "a", STANDARD, 60_000.0, 1.0, 100.0, 50.0)

    assert flow.admit(request("before"), fleet()).reason == "not_saturated"
    # Requests without a TPOT or a TPOT SLO move nothing.
    flow.observe_finished(None, 50.0)
    flow.observe_finished(90.0, None)
    assert flow.itl_fraction == pytest.approx(0.8)
    # Each miss, whatever its class, lowers the bound one step (0.02): after five, 36 ms is
    # over 0.7 x 50.
    for _ in range(5):
        flow.observe_finished(60.0, 50.0)
    assert flow.itl_fraction == pytest.approx(0.8 - 5 * ITL_BOUND_STEP)
    assert flow.admit(request("after"), fleet()).decision is Decision.QUEUE
    # A met TPOT raises it by step x (1 - 0.97) / 0.97: 97 of them undo three misses.
    for _ in range(97):
        flow.observe_finished(20.0, 50.0)
    assert flow.itl_fraction == pytest.approx(0.8 - 2 * ITL_BOUND_STEP)
    # It never goes under min_itl_fraction, nor over max_itl_fraction ...
    for _ in range(100):
        flow.observe_finished(60.0, 50.0)
    assert flow.itl_fraction == pytest.approx(0.5)
    for _ in range(100_000):
        flow.observe_finished(20.0, 50.0)
    assert flow.itl_fraction == pytest.approx(1.0)
    # ... and a bound held at an end moves off it with the next outcome.
    flow.observe_finished(60.0, 50.0)
    assert flow.itl_fraction == pytest.approx(1.0 - ITL_BOUND_STEP)
    # A new setting takes effect at once, the outcomes still counted against it.
    flow.settings = FlowControlSettings(saturation_itl_fraction=0.9, max_itl_fraction=0.95)
    assert flow.itl_fraction == pytest.approx(0.95)


def test_the_bound_rises_where_decodes_keep_pace_and_what_it_held_goes() -> None:
    # Decodes at 45 ms against a 50 ms SLO: over the starting bound (40 ms), so that replica
    # counts as full and, the other's queue being full, the request waits. Once most requests
    # meet their TPOT, the bound rises over 0.9: the slow replica has room again.
    flow = _controller(FakeClock(), saturation_itl_fraction=0.8, tpot_target=0.97)
    slow, full = ReplicaLoad(10.0, 0.0, 0, 0.5, 45.0), ReplicaLoad(10.0, 0.0, 3, 0.5, 20.0)
    estimate = FleetEstimate(200.0, (slow, full), chosen_decode_itl_ms=45.0)

    held = FlowRequest("held", "a", STANDARD, 60_000.0, 1.0, 100.0, 50.0)
    assert flow.admit(held, estimate).decision is Decision.QUEUE
    for _ in range(300):
        flow.observe_finished(30.0, 50.0)
    assert flow.itl_fraction is not None and flow.itl_fraction > 0.9
    assert flow.judge_head(estimate).decision is Decision.ADMIT  # the held one goes


def test_without_a_target_the_inter_token_bound_stays_where_it_is_set() -> None:
    flow = _controller(FakeClock(), saturation_itl_fraction=0.8, tpot_target=None)
    for _ in range(50):
        flow.observe_finished(90.0, 50.0)
    assert flow.itl_fraction == pytest.approx(0.8)
    unused = _controller(FakeClock(), saturation_itl_fraction=None)
    unused.observe_finished(90.0, 50.0)
    assert unused.itl_fraction is None
    with pytest.raises(ValueError, match="tpot_target"):
        FlowControlSettings(tpot_target=1.0)
    with pytest.raises(ValueError, match="min_itl_fraction"):
        FlowControlSettings(min_itl_fraction=0.0)
    with pytest.raises(ValueError, match="max_itl_fraction"):
        FlowControlSettings(min_itl_fraction=0.6, max_itl_fraction=0.5)


def test_room_on_a_replica_routing_did_not_choose_is_not_room_once_most_are_full() -> None:
    def fleet(chosen_itl_ms: float, *others_itl_ms: float) -> FleetEstimate:
        loads = tuple(
            ReplicaLoad(10.0, 0.0, 0, 0.5, itl) for itl in (chosen_itl_ms, *others_itl_ms)
        )
        return FleetEstimate(200.0, loads, chosen_decode_itl_ms=chosen_itl_ms)

    def request(rid: str) -> FlowRequest:
        return FlowRequest(rid, "a", STANDARD, 60_000.0, 1.0, 100.0, 50.0)

    flow = _controller(FakeClock(), saturation_itl_fraction=0.8)
    # Half the fleet is too slow, routing chose a slow one: the free one is not where it goes.
    assert flow.admit(request("half"), fleet(45.0, 30.0)).decision is Decision.QUEUE
    # Most of the fleet has room: a slow chosen replica is a passing state, and it is admitted.
    fresh = _controller(FakeClock(), saturation_itl_fraction=0.8)
    assert fresh.admit(request("most"), fleet(45.0, 30.0, 30.0, 30.0)).reason == "not_saturated"
    # A fast chosen replica is room, however many others are slow.
    assert fresh.admit(request("fast"), fleet(30.0, 45.0, 45.0, 45.0)).reason == "not_saturated"


def test_once_half_the_fleet_is_full_the_queue_is_not_released_onto_a_backlogged_replica() -> None:
    """The flood a live review found: with most replicas full, one with room let every queued
    request go, each routed (by cache affinity) onto the same replica whose engine queue was
    already at the backlog bound, while the free one stayed free."""
    clock = FakeClock()
    flow = _controller(clock, saturation_itl_fraction=None)
    room, other_room = _load("r2"), _load("r3")
    busy = _load("r1", backlog=4)

    def routed_to_backlog(waiting: int) -> FleetEstimate:
        return _routed_to(_load("r0", backlog=waiting), busy, room, other_room, ttft_ms=900.0)

    everything_full = _routed_to(_load("r0", backlog=3), busy, _load("r2", backlog=2))
    for rid in ("q1", "q2"):
        assert flow.admit(_request(rid), everything_full).decision is Decision.QUEUE
    # Half the fleet full, routing chose a full one: the head stays, however much room the
    # others have ...
    assert flow.judge_head(routed_to_backlog(2)).decision is Decision.QUEUE
    assert flow.judge_head(routed_to_backlog(5)).decision is Decision.QUEUE
    # ... until its replica's queue drains below the bound: one goes, and the next waits for
    # the one after.
    assert flow.judge_head(routed_to_backlog(1)).reason == "capacity_freed"
    assert flow.judge_head(routed_to_backlog(2)).decision is Decision.QUEUE
    # Routing chose a replica with room: that room is its own, and it goes.
    assert flow.judge_head(_routed_to(room, busy, _load("r0", backlog=2))).reason == (
        "capacity_freed"
    )
    # With most of the fleet free, one backlogged replica is a passing state: released.
    flow.admit(_request("q3"), everything_full)
    most_free = _routed_to(_load("r0", backlog=2), room, other_room, _load("r4"))
    assert flow.judge_head(most_free).reason == "capacity_freed"
    # hold_for_backlog: false, the rule before it: any room releases the head, and no idle
    # replica is offered.
    lenient = _controller(FakeClock(), saturation_itl_fraction=None, hold_for_backlog=False)
    lenient.admit(_request("q4"), everything_full)
    assert lenient.head_steer_candidates(_request("q4"), routed_to_backlog(2)) is None
    assert lenient.judge_head(routed_to_backlog(2)).reason == "capacity_freed"
    # A new arrival with nothing queued is still judged by room anywhere: held at arrival,
    # bursts at light load waited in the gateway (docs/flow-control.md, *Releasing the queue*).
    assert _controller(FakeClock()).admit(_request("new"), routed_to_backlog(2)).reason == (
        "not_saturated"
    )


def test_a_head_held_for_its_replicas_backlog_may_go_to_an_idle_replica_within_its_slo() -> None:
    """Held for its cache-affine replica's queue, the head blocked the whole queue while a
    replica ran nothing (a live review). It is offered the idle replicas, and goes to one if what
    it waited plus its expected TTFT there meets its SLO; replicas merely with room are not
    offered (sent there, multi-turn's long cold prefills cost 7-11 points of goodput)."""
    clock = FakeClock()
    flow = _controller(clock, saturation_itl_fraction=None)

    def load(
        name: str, running: int | None, backlog: int = 0, kv: float = 0.5, itl: float | None = None
    ) -> ReplicaLoad:
        return ReplicaLoad(10.0, 0.0, backlog, kv, itl, ReplicaId(name), running)

    chosen, busy = load("r0", 3, backlog=2), load("r1", 3, backlog=4)
    idle, room = load("r2", 0), load("r3", 1)
    held = _routed_to(chosen, busy, idle, room, ttft_ms=900.0)
    head = _request("h", at=clock.now)
    assert flow.head_steer_candidates(head, held) == {ReplicaId("r2")}
    # Not held for the backlog alone (every replica full), or not held at all: nothing offered.
    all_full = _routed_to(chosen, busy, load("r2", 0, backlog=2), ttft_ms=900.0)
    assert flow.head_steer_candidates(head, all_full) is None
    assert flow.head_steer_candidates(head, _routed_to(idle, chosen, busy, room)) is None
    # Unknown running counts are not idle; an idle replica full by another test (its KV cache)
    # is no place to go: held again there, it was counted as steered at every pump.
    unknown = _routed_to(chosen, busy, load("r2", None), room, ttft_ms=900.0)
    assert flow.head_steer_candidates(head, unknown) is None
    kv_full = _routed_to(chosen, busy, load("r2", 0, kv=0.95), room, ttft_ms=900.0)
    assert flow.head_steer_candidates(head, kv_full) is None
    # Held because its replica decodes too slowly too: that hold is not the backlog's.
    paced = _controller(clock)
    slow = _routed_to(load("r0", 3, backlog=2, itl=45.0), busy, idle, room, ttft_ms=900.0)
    with_tpot = FlowRequest("t", "a", STANDARD, 2000.0, 1.0, clock.now, 50.0)
    assert paced.head_steer_candidates(with_tpot, slow) is None
    assert paced.head_steer_candidates(with_tpot, held) == {ReplicaId("r2")}
    # Admitted where it is anyway (admit_within_slo_fraction): it stays on its cached replica.
    within = _controller(clock, saturation_itl_fraction=None, admit_within_slo_fraction=0.5)
    assert within.head_steer_candidates(head, held) is None
    assert within.head_steer_candidates(head, replace(held, predicted_ttft_ms=1000.5)) == {
        ReplicaId("r2")
    }
    # Taken if its wait so far plus its expected TTFT there fits the SLO (2,000 ms).
    clock.now += 1.5
    assert flow.takes_head_steer(head, replace(held, predicted_ttft_ms=500.0))
    assert not flow.takes_head_steer(head, replace(held, predicted_ttft_ms=500.5))
    assert not flow.takes_head_steer(head, replace(held, predicted_ttft_ms=None))
    assert _controller(FakeClock(), enabled=False).head_steer_candidates(head, held) is None


def test_critical_is_never_held_and_sheddable_over_its_slo_is_refused_with_a_retry_hint() -> None:
    flow = _controller(FakeClock())
    assert flow.admit(_request("c", CRITICAL), BUSY).decision is Decision.ADMIT
    late = flow.admit(_request("x", SHEDDABLE, slo_ms=1000.0), BUSY)
    assert late.decision is Decision.SHED
    assert late.shed_reason is ShedReason.PREDICTED_TTFT_OVER_SLO
    # Predicted drain of the shortest queue (5000 ms), the gateway queue empty: 5 s.
    assert late.retry_after_s == 5.0
    fits = flow.admit(_request("y", SHEDDABLE, slo_ms=3000.0), BUSY)
    assert fits.decision is Decision.QUEUE


def test_the_retry_hint_counts_the_gateway_queue_at_the_pace_it_drains() -> None:
    # The engines' queues stay short while the gateway holds the work: read alone, they said
    # 1 s to clients that then waited 20 s.
    clock = FakeClock()
    flow = _controller(clock, max_queue_wait_ms=600_000.0)
    short = _fleet(200.0, ttft_ms=1500.0, backlog=5)  # saturated, engine queues 200 ms deep
    for i in range(12):
        assert flow.admit(_request(f"q{i}", at=clock.now), short).decision is Decision.QUEUE
    assert flow.admit(_request("x", SHEDDABLE, slo_ms=1000.0), short).retry_after_s == 1.0
    # Two released a second, for 2 s: 8 still queued will take 4 s.
    for _ in range(4):
        clock.now += 0.5
        assert flow.judge_head(IDLE).decision is Decision.ADMIT
    late = flow.admit(_request("y", SHEDDABLE, slo_ms=1000.0), short)
    assert late.decision is Decision.SHED
    assert late.retry_after_s == 4.0
    # Never past what clients honour.
    clock.now += 1_000.0
    assert flow.judge_head(IDLE).decision is Decision.ADMIT
    assert flow.admit(_request("z", SHEDDABLE, slo_ms=1000.0), short).retry_after_s == 60.0
    # The queue empties; an hour later a new spell starts: the old pace is not its pace.
    while flow.head() is not None:
        flow.judge_head(IDLE)
    clock.now += 3_600.0
    assert flow.admit(_request("again", at=clock.now), short).decision is Decision.QUEUE
    assert flow.admit(_request("w", SHEDDABLE, slo_ms=1000.0), short).retry_after_s == 1.0


def test_sheddable_behind_a_queue_it_cannot_outwait_is_refused_at_once() -> None:
    """Its predicted TTFT counts the gateway queue ahead of it, not only the engines' (which
    stay short while the gateway holds the work): refused on arrival, not after waiting out its
    SLO in the queue. Before the queue has released anything, the fleet's pace of finishing
    requests says how fast it will."""
    clock = FakeClock()
    flow = _controller(clock, max_queue_wait_ms=600_000.0)
    short = _fleet(200.0, ttft_ms=1500.0, backlog=5)  # saturated, engine queues 200 ms deep
    for i in range(12):
        assert flow.admit(_request(f"q{i}", at=clock.now), short).decision is Decision.QUEUE
    # No pace known yet: the queue's wait is unknown, so the engines' 1.5 s decides: it waits.
    assert flow.admit(_request("early", SHEDDABLE, slo_ms=3000.0), short).decision is (
        Decision.QUEUE
    )
    # The fleet finishes two requests a second (admitted before the burst).
    for i in range(5):
        clock.now += 0.5
        flow.request_finished(f"done{i}")
    late = flow.admit(_request("late", SHEDDABLE, slo_ms=3000.0), short)
    assert late.decision is Decision.SHED
    assert late.shed_reason is ShedReason.PREDICTED_TTFT_OVER_SLO
    assert late.retry_after_s == 7.0  # 13 queued at 2 a second
    # A roomier SLO still queues: 1.5 s + 13 / 2 s = 8 s.
    assert flow.admit(_request("patient", SHEDDABLE, slo_ms=9000.0), short).decision is (
        Decision.QUEUE
    )
    # Standard requests are never shed on arrival for it: they queue.
    assert flow.admit(_request("std", at=clock.now), short).decision is Decision.QUEUE
    # Finishes older than the window say nothing of now.
    clock.now += 60.0
    assert flow.admit(_request("later", SHEDDABLE, slo_ms=3000.0), short).decision is (
        Decision.QUEUE
    )
    # Finishes before the fleet was saturated say how little was asked of it, not how fast it
    # goes: a lull of three finishes 4 s apart, then a burst, sheds nothing on them.
    flow = _controller(clock, max_queue_wait_ms=600_000.0)
    for i in range(3):
        clock.now += 4.0
        flow.request_finished(f"lull{i}")
    for i in range(2):
        assert flow.admit(_request(f"b{i}", at=clock.now), short).decision is Decision.QUEUE
    burst = flow.admit(_request("shed-me-not", SHEDDABLE, slo_ms=3000.0), short)
    assert burst.decision is Decision.QUEUE
    assert flow.retry_after_s() == 1.0
    # Only the standard requests ahead count: queued sheddable ones from other tenants may go
    # after it (fair queuing) or be refused rather than served.
    flow = _controller(clock, max_queue_wait_ms=600_000.0)
    for i in range(12):
        flow.admit(_request(f"x{i}", SHEDDABLE, tenant=f"t{i}", slo_ms=60_000.0), short)
    for i in range(5):
        clock.now += 0.5
        flow.request_finished(f"done{i}")
    assert flow.admit(_request("mine", SHEDDABLE, slo_ms=3000.0), short).decision is (
        Decision.QUEUE
    )


def test_strict_priority_between_classes_then_fifo_inside_a_tenant() -> None:
    flow = _controller(FakeClock())
    for rid, cls in (("x1", SHEDDABLE), ("s1", STANDARD), ("x2", SHEDDABLE), ("s2", STANDARD)):
        assert flow.admit(_request(rid, cls, slo_ms=60_000.0), BUSY).decision is Decision.QUEUE
    order = []
    while (head := flow.head()) is not None:
        assert flow.judge_head(IDLE).decision is Decision.ADMIT
        order.append(head.request_id)
    assert order == ["s1", "s2", "x1", "x2"]


def test_a_new_request_waits_behind_queued_ones_of_its_class_even_when_the_fleet_has_room() -> None:
    flow = _controller(FakeClock())
    flow.admit(_request("first"), BUSY)
    assert flow.admit(_request("second"), IDLE).decision is Decision.QUEUE
    assert flow.admit(_request("vip", CRITICAL), BUSY).decision is Decision.ADMIT


def test_weighted_fair_queuing_shares_dequeues_by_weight_whatever_the_burst() -> None:
    queue = FairQueue()
    # Tenant "big" bursts 300 requests before "small" sends 100; weights 2:1 for big.
    for i in range(300):
        queue.push(_request(f"big-{i}", tenant="big", weight=2.0))
    for i in range(100):
        queue.push(_request(f"small-{i}", tenant="small", weight=1.0))
    first = Counter(queue.pop_head().request.tenant for _ in range(150))
    assert first == {"big": 100, "small": 50}


def test_an_idle_tenant_banks_no_credit() -> None:
    queue = FairQueue()
    for i in range(10):
        queue.push(_request(f"a-{i}", tenant="a"))
    for _ in range(10):
        queue.pop_head()
    # "b" was idle while "a" was served; now both send: they alternate, b gets no catch-up run.
    for i in range(4):
        queue.push(_request(f"a2-{i}", tenant="a"))
        queue.push(_request(f"b-{i}", tenant="b"))
    tenants = [queue.pop_head().request.tenant for _ in range(8)]
    assert Counter(tenants[:4]) == {"a": 2, "b": 2}


def test_removal_from_the_middle_takes_effect_at_once() -> None:
    flow = _controller(FakeClock())
    for rid in ("a", "b", "c"):
        flow.admit(_request(rid, slo_ms=60_000.0), BUSY)
    assert flow.cancel("b") is True
    assert flow.cancel("b") is False
    assert len(flow.queue) == 2
    order = []
    while (head := flow.head()) is not None:
        flow.judge_head(IDLE)
        order.append(head.request_id)
    assert order == ["a", "c"]


def test_a_queued_request_leaves_once_it_can_no_longer_meet_its_slo() -> None:
    clock = FakeClock()
    flow = _controller(clock)
    # Predicted TTFT 1500 ms against a 2000 ms SLO: 500 ms of slack in the queue.
    assert flow.admit(_request("s"), BUSY).decision is Decision.QUEUE
    assert flow.next_deadline_s() == pytest.approx(100.5)
    clock.now = 100.4
    assert flow.expire() == []
    clock.now = 100.5
    [(request, verdict)] = flow.expire()
    assert request.request_id == "s"
    assert verdict.shed_reason is ShedReason.SLO_UNREACHABLE
    assert verdict.waited_s == pytest.approx(0.5)
    assert len(flow.queue) == 0


def test_a_request_within_its_slo_fraction_is_admitted_even_when_saturated() -> None:
    clock = FakeClock()
    flow = _controller(clock, admit_within_slo_fraction=0.8)
    # BUSY predicts 1500 ms: within 0.8 x 2000 ms, so admitted despite the full engines ...
    assert flow.admit(_request("s"), BUSY).reason == "within_slo"
    # ... but not within 0.8 x 1800 ms: it queues, as without the option.
    assert flow.admit(_request("t", slo_ms=1800.0), BUSY).decision is Decision.QUEUE
    # A newcomer never passes a queued request of its class, whatever its slack.
    assert flow.admit(_request("u", slo_ms=60_000.0), BUSY).decision is Decision.QUEUE
    # The head is judged with the wait it already has: 100 ms + 1500 ms > 0.8 x 1800 ms.
    clock.now = 100.1
    assert flow.judge_head(BUSY).decision is Decision.QUEUE
    assert flow.judge_head(_fleet(5000.0, ttft_ms=1000.0, backlog=5)).reason == "within_slo"
    assert _controller(FakeClock()).admit(_request("v"), BUSY).decision is Decision.QUEUE


def test_a_fixed_wait_bound_wins_over_the_slo_when_configured() -> None:
    clock = FakeClock()
    flow = _controller(clock, max_queue_wait_ms=100.0)
    flow.admit(_request("s", slo_ms=60_000.0), BUSY)
    clock.now = 100.1
    assert flow.judge_head(BUSY).shed_reason is ShedReason.QUEUE_WAIT_EXCEEDED


def test_a_full_queue_refuses_the_newcomer_or_evicts_a_lower_class() -> None:
    flow = _controller(FakeClock(), max_queue_length=2)
    flow.admit(_request("s1", slo_ms=60_000.0), BUSY)
    flow.admit(_request("x1", SHEDDABLE, slo_ms=60_000.0), BUSY)
    # A standard newcomer takes the sheddable one's place ...
    assert flow.admit(_request("s2", slo_ms=60_000.0), BUSY).decision is Decision.QUEUE
    [(evicted, verdict)] = flow.expire()
    assert evicted.request_id == "x1" and verdict.shed_reason is ShedReason.QUEUE_FULL
    # ... but nothing is below a sheddable newcomer: it is refused.
    full = flow.admit(_request("x2", SHEDDABLE, slo_ms=60_000.0), BUSY)
    assert full.shed_reason is ShedReason.QUEUE_FULL


def test_off_admits_everything_and_an_unknown_estimate_never_holds() -> None:
    assert _controller(FakeClock(), enabled=False).admit(_request("s"), BUSY).reason == (
        "flow_control_off"
    )
    flow = _controller(FakeClock())
    assert flow.admit(_request("x", SHEDDABLE), FleetEstimate.unknown()).decision is Decision.ADMIT


def test_settings_refuse_impossible_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="saturation_queue_wait_ms"):
        FlowControlSettings(saturation_queue_wait_ms=-1.0)
    with pytest.raises(ValueError, match="saturation_backlog_requests"):
        FlowControlSettings(saturation_backlog_requests=0)
    with pytest.raises(ValueError, match="saturation_kv_usage"):
        FlowControlSettings(saturation_kv_usage=1.5)
    with pytest.raises(ValueError, match="max_queue_wait_ms"):
        FlowControlSettings(max_queue_wait_ms=0.0)
    with pytest.raises(ValueError, match="admit_within_slo_fraction"):
        FlowControlSettings(admit_within_slo_fraction=1.5)


def test_the_estimate_is_the_decisions_own_terms() -> None:
    a, b, c = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
    decision = RoutingDecision(
        replica=b,
        fallbacks=[a],
        profile="expected-ttft",
        degraded=False,
        explanations={
            a: ReplicaExplanation(a, terms={"queue_wait_ms": 900.0, "expected_ttft_ms": 1200.0}),
            b: ReplicaExplanation(
                b,
                terms={
                    "queue_wait_ms": 300.0,
                    "expected_ttft_ms": 450.0,
                    "decode_interference_ms": 7.0,
                },
            ),
            c: ReplicaExplanation(c, terms={"queue_wait_ms": 0.0}, filtered_out_by="health"),
        },
    )
    estimate = estimate_from_decision(decision)
    assert estimate.predicted_ttft_ms == 450.0
    assert estimate.min_queue_wait_ms == 300.0
    assert sorted(estimate.loads, key=lambda load: load.queue_wait_ms) == [
        ReplicaLoad(300.0, 7.0, replica=b),
        ReplicaLoad(900.0, 0.0, replica=a),
    ]
    # With the replicas' states: the engine's waiting queue, or this gateway's requests beyond
    # what the engine last reported running, whichever is larger; and the KV usage.
    states = [
        ReplicaState(
            a,
            "http://a",
            running=4,
            waiting=3,
            inflight_requests=5,
            kv_usage=0.4,
            decode_itl_ms=35.0,
        ),
        ReplicaState(
            b,
            "http://b",
            running=2,
            waiting=0,
            inflight_requests=6,
            kv_usage=0.95,
            decode_itl_ms=22.0,
        ),
        ReplicaState(c, "http://c", waiting=9),
    ]
    with_states = estimate_from_decision(decision, states)
    # Running: the engine's gauge, or this gateway's in flight not waiting, whichever is larger.
    assert sorted(with_states.loads, key=lambda load: load.queue_wait_ms) == [
        ReplicaLoad(300.0, 7.0, 4, 0.95, 22.0, b, running_requests=6),
        ReplicaLoad(900.0, 0.0, 3, 0.4, 35.0, a, running_requests=4),
    ]
    # The chosen replica's decode pace, for "room elsewhere is not room for this request".
    assert with_states.chosen_decode_itl_ms == 22.0
    assert estimate.chosen_decode_itl_ms is None
    # A replica whose decodes have all ended (its gauge read before they did, this gateway's
    # in-flight count 0) keeps the engine's recent pace for a few seconds: it decodes nothing
    # slowly. The streaming review saw it hold requests ~3 s after the replica went idle.
    idle = [
        states[0],
        replace(states[1], running=2, finished_since_read=2, inflight_requests=0),
    ]
    after_idle = estimate_from_decision(decision, idle)
    assert after_idle.chosen_decode_itl_ms is None
    assert {load.replica: load.decode_itl_ms for load in after_idle.loads} == {a: 35.0, b: None}
    # Requests waiting only for a LoRA slot (all held, none of theirs running) are no backlog.
    slots_held = dict(max_loras=2, running_adapters=frozenset({"x", "y"}))
    lora_states = [
        replace(states[0], **slots_held, waiting_adapters=frozenset({"z"})),
        replace(states[1], **slots_held, waiting_adapters=frozenset({"x", "z"})),
    ]
    lora = estimate_from_decision(decision, lora_states)
    assert sorted((load.queue_wait_ms, load.backlog_requests) for load in lora.loads) == [
        (300.0, 4),  # "x" waits too, for KV or a sequence slot, not only for an adapter slot
        (900.0, 0),
    ]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_loras": 2, "running_adapters": {"x", "y"}, "waiting_adapters": {"z"}}, True),
        ({"max_loras": 3, "running_adapters": {"x", "y"}, "waiting_adapters": {"z"}}, False),
        ({"max_loras": 2, "running_adapters": {"x", "y"}, "waiting_adapters": {"y", "z"}}, False),
        ({"max_loras": 2, "running_adapters": {"x", "y"}, "waiting_adapters": set()}, False),
        ({"max_loras": None, "running_adapters": {"x", "y"}, "waiting_adapters": {"z"}}, False),
    ],
    ids=["all held", "a slot free", "a waiting adapter runs", "none waiting", "slots unknown"],
)
def test_waiting_only_for_slots(fields: dict[str, object], expected: bool) -> None:
    values = {k: frozenset(v) if isinstance(v, set) else v for k, v in fields.items()}
    state = ReplicaState(ReplicaId("a"), "http://a", waiting=3, **values)  # type: ignore[arg-type]
    assert state.waiting_only_for_slots is expected


def test_a_request_for_another_pool_never_waits_behind_a_saturated_one() -> None:
    flow = _controller(FakeClock())
    held = replace(_request("model-a"), pool="a")
    assert flow.admit(held, BUSY).decision is Decision.QUEUE
    # Pool "b" has room: its request goes at once, though a standard one of "a" waits.
    assert flow.admit(replace(_request("model-b"), pool="b"), IDLE).decision is Decision.ADMIT
    assert flow.admit(replace(_request("model-a2"), pool="a"), IDLE).decision is Decision.QUEUE
    # The pump judges each pool's head on its own fleet: "a" still saturated, "b" queued behind
    # nothing of its own.
    flow.admit(replace(_request("model-b2", slo_ms=60_000.0), pool="b"), BUSY)
    assert flow.pools() == ["a", "b"]
    assert flow.judge_head(BUSY, "a").decision is Decision.QUEUE
    assert flow.judge_head(IDLE, "b").decision is Decision.ADMIT
    assert [flow.head("a").request_id, flow.head("b")] == ["model-a", None]


def test_a_tenant_whose_queued_requests_were_all_refused_carries_no_debt() -> None:
    queue = FairQueue()
    for i in range(50):
        queue.push(_request(f"a-{i}", tenant="a"))
    for i in range(50):
        queue.remove(f"a-{i}")  # refused while queued: expired, or the client left
    for i in range(4):
        queue.push(_request(f"b-{i}", tenant="b"))
        queue.push(_request(f"a2-{i}", tenant="a"))
    tenants = [queue.pop_head().request.tenant for _ in range(8)]
    assert Counter(tenants[:4]) == {"a": 2, "b": 2}


def test_token_budgets_give_prompt_tokens_back_to_the_window_they_were_reserved_in() -> None:
    clock = FakeClock()
    clock.now = 170.0  # window [120, 180)
    store = MemoryBudgetStore()
    budgets = TokenBudgets(store, clock)
    budget = TokenBudget(prompt_tokens_per_minute=1000)

    async def scenario() -> None:
        reserved = await budgets.admit("t", budget, 900)
        assert reserved.admitted and reserved.window == 2
        clock.now = 185.0  # queued across the minute boundary, then refused
        assert (await budgets.admit("t", budget, 600)).admitted  # the new window's own tokens
        await budgets.release("t", budget, 900, reserved.window)
        # Not taken from the new window: it still holds its 600, and 500 more do not fit.
        assert not (await budgets.admit("t", budget, 500)).admitted
        assert (await budgets.admit("t", budget, 400)).admitted
        # A give-back never takes a counter below zero (its reservation may never have counted).
        await store.add("k", -50, 120)
        assert await store.used("k") == 0

    asyncio.run(scenario())


def test_a_prompt_larger_than_the_whole_budget_is_refused_as_never_fitting() -> None:
    budgets = TokenBudgets(MemoryBudgetStore(), FakeClock())
    check = asyncio.run(budgets.admit("t", TokenBudget(prompt_tokens_per_minute=100), 101))
    assert (check.admitted, check.exhausted, check.can_fit) == (False, "prompt", False)


def test_token_budgets_reserve_prompt_tokens_and_refuse_until_the_next_window() -> None:
    clock = FakeClock()
    clock.now = 150.0  # 30 s into the window [120, 180)
    budgets = TokenBudgets(MemoryBudgetStore(), clock)
    budget = TokenBudget(prompt_tokens_per_minute=1000, completion_tokens_per_minute=500)

    async def scenario() -> None:
        assert (await budgets.admit("t", budget, 600)).admitted
        refused = await budgets.admit("t", budget, 600)
        assert (refused.admitted, refused.exhausted, refused.retry_after_s) == (
            False,
            "prompt",
            30.0,
        )
        assert (await budgets.admit("other", budget, 600)).admitted  # per tenant
        await budgets.charge_completion("t", budget, 500)
        assert (await budgets.admit("t", budget, 10)).exhausted == "completion"
        clock.now = 180.0  # the next window
        assert (await budgets.admit("t", budget, 900)).admitted

    asyncio.run(scenario())


def test_the_yaml_section_sets_the_critical_target_and_refuses_impossible_ones() -> None:
    from gateway.flow_control import settings_of
    from routing.config.errors import PolicyError
    from routing.config.loader import parse_policy

    fleet = """
version: 1
replica_pools:
  - {name: pool-a, replicas: ["http://127.0.0.1:9"]}
models:
  - {name: base-model, pools: [pool-a]}
"""
    policy = parse_policy(
        fleet + "flow_control: {enabled: true, tpot_target: 0.95, min_itl_fraction: 0.6, "
        "max_itl_fraction: 0.9}\n"
    )
    settings = settings_of(policy)
    assert (settings.tpot_target, settings.min_itl_fraction, settings.max_itl_fraction) == (
        0.95,
        0.6,
        0.9,
    )
    assert settings_of(parse_policy(fleet)).tpot_target == 0.97  # the default
    fixed = parse_policy(fleet + "flow_control: {enabled: true, tpot_target: null}\n")
    assert settings_of(fixed).tpot_target is None
    with pytest.raises(PolicyError, match="tpot_target"):
        parse_policy(fleet + "flow_control: {tpot_target: 1.5}\n")
    calm = settings_of(
        parse_policy(fleet + "flow_control: {steer_when_calm: false, calm_window_s: 2}\n")
    )
    assert (calm.steer_when_calm, calm.calm_window_s) == (False, 2.0)
    assert settings_of(parse_policy(fleet)).hold_for_backlog is True
    released = parse_policy(fleet + "flow_control: {hold_for_backlog: false}\n")
    assert settings_of(released).hold_for_backlog is False
    assert (
        settings_of(parse_policy(fleet)).steer_when_calm,
        settings_of(parse_policy(fleet)).calm_window_s,
    ) == (True, 5.0)
    with pytest.raises(PolicyError, match="calm_window_s"):
        parse_policy(fleet + "flow_control: {calm_window_s: -1}\n")
    with pytest.raises(PolicyError, match="renamed tpot_target"):
        parse_policy(fleet + "flow_control: {critical_tpot_target: 0.99}\n")
    with pytest.raises(PolicyError, match="max_itl_fraction"):
        parse_policy(fleet + "flow_control: {min_itl_fraction: 0.7, max_itl_fraction: 0.6}\n")


def test_a_decision_keeps_the_rest_of_another_order_to_retry_on() -> None:
    a, b, c, d = (ReplicaId(name) for name in "abcd")
    among_few = RoutingDecision(c, [d], "fleet-cost", False, {}, {"total": 1.0})
    kept = among_few.with_fallbacks([a, c, b, d])
    assert (kept.replica, kept.fallbacks) == (c, [d, a, b])
    assert (kept.profile, kept.timings_ms) == ("fleet-cost", {"total": 1.0})
    assert among_few.fallbacks == [d]  # the original is unchanged


def _critical(
    tpot_slo_ms: float | None = 50.0, request_class: RequestClass = CRITICAL
) -> FlowRequest:
    return FlowRequest("c1", "a", request_class, 2000.0, 1.0, 100.0, tpot_slo_ms)


def _load(name: str, itl_ms: float = 10.0, backlog: int = 0, kv: float = 0.5) -> ReplicaLoad:
    return ReplicaLoad(10.0, 0.0, backlog, kv, itl_ms, ReplicaId(name))


def _routed_to(
    first: ReplicaLoad, *others: ReplicaLoad, ttft_ms: float | None = 300.0
) -> FleetEstimate:
    """Routing chose ``first``'s replica, with this expected TTFT there."""
    return FleetEstimate(
        ttft_ms,
        (first, *others),
        chosen_decode_itl_ms=first.decode_itl_ms,
        chosen_replica=first.replica,
    )


def test_a_critical_request_on_a_too_slow_replica_is_routed_again_among_those_with_room() -> None:
    flow = _controller(FakeClock())  # defaults: the inter-token bound starts at 0.8 x the SLO
    assert flow.settings.steer_critical is True
    fleet = _routed_to(
        _load("slow", itl_ms=45.0),  # 45 ms > 0.8 x 50 ms: too slow for this TPOT
        _load("backlogged", backlog=3),  # full: requests wait to start there
        _load("kv-full", kv=0.95),  # full: its KV cache
        _load("paced", itl_ms=41.0),  # full: also too slow
        _load("roomy"),
        _load("roomy-too", itl_ms=39.0),
    )
    assert flow.steer_candidates(_critical(), fleet) == {ReplicaId("roomy"), ReplicaId("roomy-too")}
    # Routing's choice keeps pace: nothing to steer from.
    assert (
        flow.steer_candidates(_critical(), _routed_to(_load("ok", itl_ms=35.0), _load("b"))) is None
    )
    # No replica has room.
    full = _routed_to(_load("slow", itl_ms=45.0), _load("b", backlog=2))
    assert flow.steer_candidates(_critical(), full) is None
    # A request already past its TTFT SLO where routing sent it (2,000 ms here) stays: late
    # anywhere, its long prefill would only slow the decodes of a replica that has room.
    late = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"), ttft_ms=2000.5)
    assert flow.steer_candidates(_critical(), late) is None
    on_time = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"), ttft_ms=2000.0)
    assert flow.steer_candidates(_critical(), on_time) == {ReplicaId("roomy")}
    # The new decision is taken only if the request's expected TTFT there is no worse.
    critical = _critical()
    assert flow.takes_steer(critical, fleet, replace(fleet, predicted_ttft_ms=300.0))
    assert flow.takes_steer(critical, fleet, replace(fleet, predicted_ttft_ms=120.0))
    assert not flow.takes_steer(critical, fleet, replace(fleet, predicted_ttft_ms=300.5))
    assert not flow.takes_steer(critical, fleet, replace(fleet, predicted_ttft_ms=None))


def test_only_requests_with_a_tpot_slo_are_steered_and_only_when_enabled() -> None:
    fleet = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"))
    roomy = {ReplicaId("roomy")}
    flow = _controller(FakeClock())
    assert flow.steer_candidates(_critical(), fleet) == roomy
    assert flow.steer_candidates(_critical(tpot_slo_ms=None), fleet) is None
    off = _controller(FakeClock(), steer_critical=False)
    assert off.steer_candidates(_critical(), fleet) is None
    assert _controller(FakeClock(), enabled=False).steer_candidates(_critical(), fleet) is None
    # A policy that estimates no TTFT gives nothing to compare.
    no_ttft = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"), ttft_ms=None)
    assert flow.steer_candidates(_critical(), no_ttft) is None


def test_other_classes_are_steered_only_instead_of_waiting_on_a_calm_fleet() -> None:
    """A standard or sheddable request is steered only where it would be held (routing chose
    a replica decoding too slowly, and half the fleet is full) and the fleet is calm: nothing
    queued, nothing held for ``calm_window_s`` (5 s by default)."""
    clock = FakeClock()
    flow = _controller(clock)
    assert flow.settings.steer_when_calm is True
    assert flow.settings.calm_window_s == 5.0
    standard, sheddable = _critical(request_class=STANDARD), _critical(request_class=SHEDDABLE)
    held_here = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"))  # half full: it would wait
    assert flow.admit(standard, held_here).decision is Decision.QUEUE  # what it would do unsteered
    flow.cancel(standard.request_id)
    clock.now += 5.0  # calm again
    assert flow.steer_candidates(standard, held_here) == {ReplicaId("roomy")}
    assert flow.steer_candidates(sheddable, held_here) == {ReplicaId("roomy")}
    # Admitted where it is (fewer than half full): nothing to steer; critical ones still are.
    admitted_here = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"), _load("roomy-too"))
    paced = FlowRequest("s2", "a", STANDARD, 2000.0, 1.0, 100.0, 50.0)
    assert flow.admit(paced, admitted_here).decision is Decision.ADMIT
    assert flow.steer_candidates(standard, admitted_here) is None
    assert flow.steer_candidates(_critical(), admitted_here) == {
        ReplicaId("roomy"),
        ReplicaId("roomy-too"),
    }
    # A request held: the fleet is not calm while anything is queued, nor for 5 s after.
    everything_full = _routed_to(_load("a", backlog=2), _load("busy", backlog=2))
    assert flow.admit(_request("held"), everything_full).decision is Decision.QUEUE
    assert flow.steer_candidates(standard, held_here) is None
    assert flow.cancel("held")
    clock.now += 4.9
    assert flow.steer_candidates(standard, held_here) is None
    assert flow.steer_candidates(_critical(), held_here) == {ReplicaId("roomy")}  # regardless
    clock.now += 0.1
    assert flow.steer_candidates(standard, held_here) == {ReplicaId("roomy")}
    # Already past its TTFT SLO at routing's choice: it stays (and waits or is refused).
    late = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"), ttft_ms=2000.5)
    assert flow.steer_candidates(standard, late) is None
    off = _controller(FakeClock(), steer_when_calm=False)
    assert off.steer_candidates(standard, held_here) is None
    assert off.steer_candidates(_critical(), held_here) == {ReplicaId("roomy")}
    # It would otherwise wait, so the new decision is taken if it meets the TTFT SLO (2,000 ms),
    # even when worse than the first (a cached prefix given up for a replica with room).
    assert flow.takes_steer(standard, held_here, replace(held_here, predicted_ttft_ms=2000.0))
    assert not flow.takes_steer(standard, held_here, replace(held_here, predicted_ttft_ms=2000.5))
    assert not flow.takes_steer(standard, held_here, replace(held_here, predicted_ttft_ms=None))
    assert not flow.takes_steer(_critical(), held_here, replace(held_here, predicted_ttft_ms=301))
    with pytest.raises(ValueError, match="calm_window_s"):
        FlowControlSettings(calm_window_s=-1.0)


def test_steering_keeps_the_first_judgement_unless_the_new_decision_is_taken() -> None:
    """``steer_request``, which the gateway and the simulator both drive: routing again among
    the replicas with room, taking the new decision only when it is no worse, and otherwise
    restoring what routing again overwrote on the request (its overflow verdict)."""
    from routing.contracts import RoutingRequest
    from routing.flow_control import steer_request

    flow = _controller(FakeClock())
    first = _routed_to(_load("slow", itl_ms=45.0), _load("roomy"), _load("busy", backlog=5))
    routing_request = RoutingRequest("c1", "m", None, "a", "r", 100)
    asked: list[frozenset[ReplicaId]] = []

    def route_among(ttft_ms: float | None, fails: bool = False):  # type: ignore[no-untyped-def]
        async def route(room: frozenset[ReplicaId]) -> FleetEstimate:
            asked.append(room)
            routing_request.overflow = True  # routing again judges the request afresh
            if fails:
                raise RuntimeError("gone")
            return _routed_to(_load("roomy"), ttft_ms=ttft_ms)

        return route

    def run(route):  # type: ignore[no-untyped-def]
        routing_request.overflow = False
        return asyncio.run(
            steer_request(flow, _critical(), first, routing_request, lambda e: e, route)
        )

    taken = run(route_among(250.0))
    assert taken.steered and taken.routed.chosen_replica == ReplicaId("roomy")
    assert taken.estimate.predicted_ttft_ms == 250.0
    assert routing_request.overflow is True  # the new decision's own judgement
    assert asked == [{ReplicaId("roomy")}]
    for route in (route_among(300.5), route_among(None), route_among(250.0, fails=True)):
        kept = run(route)
        assert not kept.steered and kept.routed is first and kept.estimate is first
        assert routing_request.overflow is False  # the first judgement, restored
    # Nothing to steer: routing is not asked again.
    asked.clear()
    no_tpot_slo = _critical(tpot_slo_ms=None)
    assert (
        asyncio.run(
            steer_request(flow, no_tpot_slo, first, routing_request, lambda e: e, route_among(1.0))
        ).routed
        is first
    )
    assert asked == []


def test_sustained_overload_with_expiry_still_shares_by_weight() -> None:
    # Tagged on arrival, requests whose wait ran out still pushed their tenant's tags ahead of
    # the clock: at weights 3:1, both sending 4 requests/s to a queue served 3.3 times a
    # second, the lighter tenant got 8 of 200 served (the flow-control review). Only a
    # tenant's oldest waiting request is tagged now, from the last one served.
    queue = FairQueue()
    arrived: dict[str, float] = {}
    served: Counter[str] = Counter()
    for tick in range(600):  # 60 s in 100 ms ticks
        now = tick / 10
        if tick % 5 == 0:
            for tenant, weight in (("heavy", 3.0), ("light", 1.0)):
                for _ in range(2):
                    rid = f"{tenant}-{len(arrived)}"
                    queue.push(_request(rid, tenant=tenant, weight=weight))
                    arrived[rid] = now
        for entry in list(queue.entries()):  # each waits 8 s at most (its SLO)
            if now - arrived[entry.request.request_id] >= 8.0:
                queue.remove(entry.request.request_id)
        if tick % 3 == 0 and len(queue):
            served[queue.pop_head().request.tenant] += 1
    share = served["light"] / sum(served.values())
    assert 0.2 <= share <= 0.3, served


def test_a_request_no_replica_can_fit_goes_through_to_the_engines_refusal() -> None:
    """The simulate review of session 46: such a request was shed under overload (a 429 whose
    client retries it for ever) or queued for nothing, where the engine refuses it at once."""
    from dataclasses import replace

    clock = FakeClock()
    controller = _controller(clock, enabled=True)
    too_long = replace(_request("long", SHEDDABLE, slo_ms=1000.0), fits_no_replica=True)
    verdict = controller.admit(too_long, BUSY)
    assert verdict.decision is Decision.ADMIT and verdict.reason == "fits_no_replica"
    short = _request("short", SHEDDABLE, slo_ms=1000.0)  # its predicted 1,500 ms: shed
    assert controller.admit(short, BUSY).decision is Decision.SHED
