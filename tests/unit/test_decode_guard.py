"""Protected critical decodes: the stall budgets, and the holds flow control makes by them
(``protect_critical_decodes``, off by default)."""

from __future__ import annotations

import pytest

from routing.contracts import ReplicaExplanation, RoutingDecision
from routing.flow_control import (
    Decision,
    FleetEstimate,
    FlowController,
    FlowControlSettings,
    FlowRequest,
    RequestClass,
    estimate_from_decision,
)
from routing.flow_control.decode_guard import DecodeGuard
from routing.flow_control.estimate import ReplicaLoad
from routing.types import ReplicaId

CRITICAL, STANDARD = RequestClass.CRITICAL, RequestClass.STANDARD
A, B = ReplicaId("a"), ReplicaId("b")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _protect(guard: DecodeGuard, rid: str, tokens: int = 11, itl_ms: float = 30.0) -> None:
    """A critical request on replica A whose budget is (tokens - 1) x (50 - itl) ms."""
    guard.admitted(
        rid, A, 100.0, 100.0, protect=True, output_tokens=tokens, tpot_slo_ms=50.0,
        ttft_slo_ms=2000.0, decode_itl_ms=itl_ms,
    )  # fmt: skip


def test_a_critical_decode_absorbs_its_tpot_slack_and_each_later_prefill_spends_it() -> None:
    guard = DecodeGuard()
    _protect(guard, "c")  # 10 x (50 - 30) = 200 ms of stall
    assert not guard.endangers(A, 199.0, 100.0)
    assert guard.endangers(A, 201.0, 100.0)
    assert not guard.endangers(B, 10_000.0, 100.0)  # another replica's decodes are not stalled
    guard.admitted("s", A, 150.0, 100.0)  # a prefill lands there: 50 ms left
    assert guard.endangers(A, 51.0, 100.0)
    assert not guard.endangers(A, 49.0, 100.0)
    guard.finished("c")
    assert not guard.endangers(A, 10_000.0, 100.0)
    assert len(guard) == 0


def test_a_budget_spent_past_zero_or_outliving_its_slo_is_dropped() -> None:
    guard = DecodeGuard()
    _protect(guard, "c")
    guard.admitted("big", A, 500.0, 100.0)  # it has missed: nothing is held for it any more
    assert len(guard) == 0
    _protect(guard, "d")  # lives 2 s + 11 x 50 ms = 2.55 s
    assert guard.endangers(A, 300.0, 102.5)
    assert not guard.endangers(A, 300.0, 102.6)  # its finish was never reported
    assert len(guard) == 0


@pytest.mark.parametrize(
    ("tokens", "tpot_slo_ms", "itl_ms"),
    [(1, 50.0, 10.0), (None, 50.0, 10.0), (20, None, 10.0), (20, 50.0, 55.0)],
    ids=["one-token", "no-max-tokens", "no-tpot-slo", "already-over-its-slo"],
)
def test_nothing_is_protected_without_a_decode_that_can_still_meet_its_tpot(
    tokens: int | None, tpot_slo_ms: float | None, itl_ms: float
) -> None:
    guard = DecodeGuard()
    guard.admitted(
        "c", A, 0.0, 100.0, protect=True, output_tokens=tokens, tpot_slo_ms=tpot_slo_ms,
        decode_itl_ms=itl_ms,
    )  # fmt: skip
    assert len(guard) == 0


# ---------------------------------------------------------------- the controller's holds

FREE = ReplicaLoad(0.0, 0.0, 0, 0.5)
FULL = ReplicaLoad(3000.0, 0.0, 5, 0.5)


def _estimate(prefill_ms: float, *loads: ReplicaLoad, ttft_ms: float = 500.0) -> FleetEstimate:
    """Routing chose replica A with a prefill of ``prefill_ms``."""
    return FleetEstimate(ttft_ms, loads or (FREE, FULL), 20.0, A, prefill_ms)


def _request(rid: str, request_class: RequestClass, tokens: int = 11) -> FlowRequest:
    return FlowRequest(rid, "t", request_class, 2000.0, 1.0, 100.0, 50.0, tokens)


def _with_protected_decode(
    clock: FakeClock, protect: bool = True, behind: bool = True
) -> FlowController:
    """A controller whose replica A runs critical request "c": 10 x (50 - 20) = 300 ms of
    stall budget; ``behind``: a request has just missed its TPOT (the bound moved down)."""
    flow = FlowController(FlowControlSettings(protect_critical_decodes=protect), clock)
    if behind:
        flow.observe_finished(60.0, 50.0)
    verdict = flow.admit(_request("c", CRITICAL), _estimate(100.0, FREE, FREE))
    assert verdict.decision is Decision.ADMIT
    assert len(flow.guard) == (1 if flow.settings.protect_critical_decodes else 0)
    return flow


def test_a_prefill_that_would_sink_a_critical_decode_waits_while_decodes_fall_behind() -> None:
    clock = FakeClock()
    flow = _with_protected_decode(clock)
    assert flow.admit(_request("small", STANDARD), _estimate(250.0)).decision is Decision.ADMIT
    # 50 ms of budget left: a 400 ms prefill on A would push "c" past its TPOT.
    held = flow.admit(_request("long", STANDARD), _estimate(400.0))
    assert (held.decision, held.reason) == (Decision.QUEUE, "protecting_critical_decode")
    assert flow.judge_head(_estimate(400.0)).decision is Decision.QUEUE
    flow.request_finished("c")  # its decode ended: nothing left to protect
    assert flow.judge_head(_estimate(400.0)).decision is Decision.ADMIT


def test_while_decodes_keep_their_tpot_nothing_waits_for_a_protected_decode() -> None:
    flow = _with_protected_decode(FakeClock(), behind=False)
    assert flow.admit(_request("long", STANDARD), _estimate(400.0)).decision is Decision.ADMIT
    # That prefill sank "c"; another critical decode starts there, then a request misses its
    # TPOT: the bound moves below its start, and the next long prefill waits.
    assert (
        flow.admit(_request("c2", CRITICAL), _estimate(0.0, FREE, FREE)).decision is Decision.ADMIT
    )
    flow.observe_finished(60.0, 50.0)
    assert flow.admit(_request("long2", STANDARD), _estimate(400.0)).decision is Decision.QUEUE


def test_with_every_replica_free_nothing_waits_for_a_protected_decode() -> None:
    flow = _with_protected_decode(FakeClock())
    verdict = flow.admit(_request("long", STANDARD), _estimate(400.0, FREE, FREE))
    assert verdict.decision is Decision.ADMIT


def test_protection_off_by_default_admits_what_it_would_have_held() -> None:
    assert FlowControlSettings().protect_critical_decodes is False
    flow = _with_protected_decode(FakeClock(), protect=False)
    assert flow.admit(_request("long", STANDARD), _estimate(400.0)).decision is Decision.ADMIT


def test_critical_requests_are_never_held_for_a_protected_decode() -> None:
    flow = _with_protected_decode(FakeClock())
    verdict = flow.admit(_request("c2", CRITICAL), _estimate(400.0))
    assert verdict.decision is Decision.ADMIT
    # Its prefill spent "c"'s budget past zero (that decode is lost), and it is protected now.
    assert len(flow.guard) == 1
    assert flow.admit(_request("long", STANDARD), _estimate(400.0)).decision is Decision.QUEUE


def test_the_estimate_names_the_chosen_replica_and_its_predicted_prefill() -> None:
    explanations = {
        A: ReplicaExplanation(
            A, 2, terms={"queue_wait_ms": 10.0, "expected_ttft_ms": 90.0, "prefill_ms": 80.0}
        ),
        B: ReplicaExplanation(B, terms={"queue_wait_ms": 0.0, "expected_ttft_ms": 200.0}),
    }
    decision = RoutingDecision(
        replica=A, fallbacks=[B], profile="fleet-cost", degraded=False, explanations=explanations
    )
    estimate = estimate_from_decision(decision)
    assert (estimate.chosen_replica, estimate.chosen_prefill_ms) == (A, 80.0)
