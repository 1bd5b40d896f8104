"""The requested output budget: parsed from every API's field, observed per (route, pool).

``fleetgate advise`` keeps ``--max-model-len`` at or above the longest prompt + requested budget
(``fleetgate_request_budget_tokens``): vLLM refuses prompt + max_tokens over the flag, whatever
the request goes on to generate.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace

import pytest

from gateway.cost import RouteWindow
from gateway.metrics import GatewayMetrics
from gateway.policy_view import Route, Tenant
from gateway.proxy import UpstreamOutcome
from gateway.request.account import account
from gateway.request.route import RouteDecision, output_budget
from routing.contracts import RoutingDecision, RoutingRequest, TokenizedPrompt
from routing.types import ReplicaId


@pytest.mark.parametrize(
    ("body", "budget"),
    [
        ({"max_completion_tokens": 300, "max_tokens": 100}, 300),
        ({"max_tokens": 4096}, 4096),
        ({"max_output_tokens": 2048}, 2048),  # Responses API
        ({}, None),
        ({"max_tokens": "lots"}, None),
        ({"max_tokens": True}, None),
    ],
)
def test_output_budget_reads_each_api_field(body: dict[str, object], budget: int | None) -> None:
    assert output_budget({"model": "m", **body}) == budget


class _Engine:
    def observe_complete(self, *args: object) -> None:
        pass


class _Layout:
    def observe(self, *args: object) -> None:
        pass


def _deps() -> SimpleNamespace:
    return SimpleNamespace(
        metrics=GatewayMetrics(),
        window=RouteWindow(),
        engine=_Engine(),
        layout=_Layout(),
        decisions=deque(),
        speculative=None,
        speculative_target=None,
        registry=SimpleNamespace(get=lambda _: None),
    )


def _routed(budget: int | None) -> RouteDecision:
    request = RoutingRequest(
        request_id="r1",
        model="m",
        adapter=None,
        tenant="t",
        route="chat",
        prompt_tokens=1400,
        max_output_tokens=budget,
    )
    decision = RoutingDecision(
        replica=ReplicaId("r"), fallbacks=[], profile="default", degraded=False, explanations={}
    )
    return RouteDecision(
        Route("chat"),
        Tenant("t"),
        "m",
        None,
        TokenizedPrompt(token_ids=[]),
        16,
        request,
        decision,
        False,
        0.0,
    )


def _served() -> UpstreamOutcome:
    return UpstreamOutcome(
        replica=ReplicaId("r"),
        status=200,
        usage={"prompt_tokens": 1400, "completion_tokens": 180},
        replica_seconds={"gpu": 1.0},
        finished_at=1.0,
    )


def _sample(gw: SimpleNamespace, name: str, le: str | None = None) -> float | None:
    labels = {"route": "chat", "pool": "gpu"} | ({"le": le} if le else {})
    return gw.metrics.registry.get_sample_value(name, labels)


def test_budget_histogram_observes_prompt_plus_requested_output() -> None:
    # A 1,400-token prompt asking for 4,096 tokens that generated 180: the context histogram sees
    # 1,580, the budget histogram 5,496 (what vLLM checks against --max-model-len).
    gw = _deps()
    account(gw, _routed(4096), _served(), arrived=0.0, streamed=False)
    assert _sample(gw, "fleetgate_request_context_tokens_sum") == 1580
    assert _sample(gw, "fleetgate_request_budget_tokens_sum") == 1400 + 4096
    assert _sample(gw, "fleetgate_request_budget_tokens_bucket", "6144.0") == 1
    assert _sample(gw, "fleetgate_request_budget_tokens_bucket", "4096.0") == 0


def test_request_without_a_budget_is_not_observed() -> None:
    gw = _deps()
    account(gw, _routed(None), _served(), arrived=0.0, streamed=False)
    assert _sample(gw, "fleetgate_request_context_tokens_count") == 1
    assert _sample(gw, "fleetgate_request_budget_tokens_count") is None


def _calibrated(gw: SimpleNamespace) -> list[float | None]:
    """The TTFTs ``gw``'s routing engine is given to calibrate with, as they come."""
    seen: list[float | None] = []

    class Engine:
        def observe_complete(self, request: object, replica: object, ttft_ms: float | None,
                             cached: object, ok: bool) -> None:
            seen.append(ttft_ms)

    gw.engine = Engine()
    return seen


def test_calibration_sees_the_ttft_from_the_decision_not_from_arrival() -> None:
    # Flow control held the request 2 s, then routed it again; the engine answered its first
    # token 0.4 s after that decision. Routing predicted the 0.4 s: it must learn 0.4 s, not the
    # client's 2.4 s (which made every replica look slower the longer the gateway queue was).
    gw = _deps()
    seen = _calibrated(gw)
    routed = dataclasses.replace(_routed(None), decided_at=102.0)
    outcome = dataclasses.replace(_served(), sent_at=102.05, ttft_s=0.35, finished_at=103.0)
    account(gw, routed, outcome, arrived=100.0, streamed=True)
    assert seen == [pytest.approx(400.0)]
    # The client's TTFT, from arrival, is what the metrics and SLOs see.
    ttft = gw.metrics.registry.get_sample_value(
        "fleetgate_ttft_seconds_sum", {"route": "chat", "model": "m"}
    )
    assert ttft == pytest.approx(2.4)
    # Served by a fallback after a failed attempt: the failed attempt's time is not the
    # fallback's prefill, so nothing is learned.
    account(gw, routed, dataclasses.replace(outcome, attempts=2), arrived=100.0, streamed=True)
    assert seen[-1] is None


def test_a_non_streamed_answer_calibrates_from_its_time_less_its_decode() -> None:
    # Without a first token to see, a fleet of non-streaming clients never calibrated: the
    # estimate is the time from the decision less the decode at the engine's recent ITL.
    gw = _deps()
    seen = _calibrated(gw)
    itl: dict[str, float | None] = {"ms": 2.0}
    gw.registry = SimpleNamespace(get=lambda _: SimpleNamespace(decode_itl_ms=itl["ms"]))
    routed = dataclasses.replace(_routed(None), decided_at=100.0)
    # 180 tokens in 1.0 s: 179 gaps of 2 ms are 358 ms of decode, the rest (642 ms) its TTFT.
    outcome = dataclasses.replace(_served(), sent_at=100.01, finished_at=101.0)
    account(gw, routed, outcome, arrived=99.0, streamed=False)
    assert seen == [pytest.approx(1000.0 - 179 * 2.0)]
    # One token: its time is its TTFT, whatever the ITL.
    one = dataclasses.replace(outcome, usage={"prompt_tokens": 1400, "completion_tokens": 1})
    itl["ms"] = None
    account(gw, routed, one, arrived=99.0, streamed=False)
    assert seen[-1] == pytest.approx(1000.0)
    # No recent ITL, a decode over half the time (4 ms x 179), or a retried request: nothing.
    account(gw, routed, outcome, arrived=99.0, streamed=False)
    itl["ms"] = 4.0
    account(gw, routed, outcome, arrived=99.0, streamed=False)
    itl["ms"] = 2.0
    account(gw, routed, dataclasses.replace(outcome, attempts=2), arrived=99.0, streamed=False)
    # A background Response, settled when the watcher's poll saw it end: its time is the poll's.
    account(gw, routed, dataclasses.replace(one, settled_later=True), arrived=99.0, streamed=False)
    assert seen[-4:] == [None, None, None, None]
