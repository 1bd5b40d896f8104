"""``expected-ttft``: the cost terms, the choice they lead to, and online calibration."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from routing.contracts import RoutingRequest
from routing.engine import Profile, RoutingEngine
from routing.policies.expected_ttft import ExpectedTtftScorer
from routing.policies.max_score import MaxScorePicker
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId

NOW = 1_000_000.0


def at_now(params: ExpectedTtftScorer.Params | None = None) -> ExpectedTtftScorer:
    """A scorer whose clock reads ``NOW``, so replica figures read at ``NOW`` are fresh."""
    return ExpectedTtftScorer(params, clock=lambda: NOW)


def profile() -> Profile:
    """The built-in expected-ttft profile's shape, with the test clock."""
    return Profile("expected-ttft", (), ((at_now(), 1.0),), MaxScorePicker())


def rep(rid: str = "a", **fields: Any) -> ReplicaState:
    fields.setdefault("models", frozenset({"m"}))
    fields.setdefault("metrics_read_at", NOW)
    fields.setdefault("prefill_tokens_per_s", 10_000.0)
    fields.setdefault("decode_step_ms", 30.0)
    return ReplicaState(replica_id=ReplicaId(rid), url=f"http://{rid}", **fields)


def req(**fields: Any) -> RoutingRequest:
    values: dict[str, Any] = {
        "request_id": "r", "model": "m", "adapter": None, "tenant": "t", "route": "d",
        "prompt_tokens": 2_000, "chain": [BlockHash(i) for i in range(125)], "seed": 1,
    }
    values.update(fields)
    return RoutingRequest(**values)


# Each row: replica fields, request fields, expected terms (ms unless named otherwise).
ESTIMATES = [
    pytest.param({}, {}, {"prefill_ms": 200.0, "uncached_tokens": 2_000, "queue_wait_ms": 0.0},
                 id="cold prompt, idle replica"),
    pytest.param({}, {"prefix_matches": {ReplicaId("a"): 100}},
                 {"prefill_ms": 40.0, "uncached_tokens": 400}, id="1600 of 2000 tokens cached"),
    pytest.param({}, {"prefix_matches": {ReplicaId("a"): 500}},
                 {"prefill_ms": 0.0, "uncached_tokens": 0}, id="match longer than prompt"),
    pytest.param({"inflight_prefill_tokens": 5_000}, {}, {"queue_wait_ms": 500.0},
                 id="gateway backlog"),
    pytest.param({"waiting": 20, "inflight_prefill_tokens": 5_000}, {},
                 {"queue_wait_ms": 1_024.0}, id="engine queue larger: 20 x 512 tokens"),
    pytest.param({"running": 10}, {}, {"queue_wait_ms": 15.0}, id="decode contention 10x30x0.05"),
    pytest.param({"prefill_tokens_per_s": 2_000.0}, {}, {"prefill_ms": 1_000.0}, id="slow"),
    pytest.param({}, {"adapter": "ad"}, {"adapter_cold_load_ms": 500.0}, id="adapter cold"),
    pytest.param({"loaded_adapters": frozenset({"ad"})}, {"adapter": "ad"},
                 {"adapter_cold_load_ms": 0.0}, id="adapter resident"),
    pytest.param({"cpu_cached_adapters": frozenset({"ad"})}, {"adapter": "ad"},
                 {"adapter_cold_load_ms": 50.0}, id="adapter in host memory"),
    pytest.param({}, {"adapter": "ad", "adapter_cold_load_ms": {ReplicaId("a"): 1_234.0}},
                 {"adapter_cold_load_ms": 1_234.0}, id="registry estimate wins"),
    pytest.param({"kv_usage": 0.85}, {}, {"kv_penalty_ms": 0.0}, id="kv below knee"),
    pytest.param({"kv_usage": 0.95}, {}, {"kv_penalty_ms": 500.0}, id="kv half-way past knee"),
    pytest.param({"kv_usage": 1.0}, {}, {"kv_penalty_ms": 2_000.0}, id="kv full"),
    pytest.param({"metrics_read_at": NOW - 1.5}, {}, {"stale_penalty_ms": 0.0}, id="fresh"),
    pytest.param({"metrics_read_at": NOW - 12}, {}, {"stale_penalty_ms": 1_000.0}, id="stale"),
    pytest.param({"metrics_read_at": NOW - 600}, {}, {"stale_penalty_ms": 5_000.0},
                 id="stale, capped"),
]


@pytest.mark.parametrize(("replica_fields", "request_fields", "expected"), ESTIMATES)
def test_cost_terms(
    replica_fields: dict[str, Any], request_fields: dict[str, Any], expected: dict[str, float]
) -> None:
    estimate = at_now().estimate(req(**request_fields), rep(**replica_fields), NOW)
    terms = estimate.as_terms()
    for name, value in expected.items():
        assert terms[name] == pytest.approx(value), name
    parts = ("queue_wait_ms", "prefill_ms", "adapter_cold_load_ms", "kv_penalty_ms",
             "stale_penalty_ms")
    assert terms["expected_ttft_ms"] == pytest.approx(sum(terms[p] for p in parts))


def test_scores_are_relative_cost_with_a_floor() -> None:
    scorer = at_now(ExpectedTtftScorer.Params(cost_floor_ms=10.0))
    replicas = [rep("fast"), rep("slow", inflight_prefill_tokens=4_000)]
    scores, terms = scorer.score_with_terms(req(), replicas)
    # fast: 200 ms, slow: 400 + 200 ms
    assert scores == {"fast": 1.0, "slow": pytest.approx(210 / 610)}
    assert terms[ReplicaId("slow")]["queue_wait_ms"] == pytest.approx(400.0)


@pytest.mark.parametrize(
    ("cached_queue_tokens", "expected"),
    [
        (1_000, "cached"),  # 100 ms queue + 40 ms prefill beats 200 ms of full prefill
        (30_000, "idle"),  # a 3 s queue is not worth a 160 ms saving
    ],
)
async def test_cache_versus_queue_tradeoff(cached_queue_tokens: int, expected: str) -> None:
    engine = RoutingEngine(None, {"expected-ttft": profile()})
    replicas = [
        rep("cached", inflight_prefill_tokens=cached_queue_tokens),
        rep("idle"),
    ]
    # Only "cached" holds 100 of the 125 blocks; the picker sees expected TTFT only.
    request = req(prefix_matches={ReplicaId("cached"): 100}, prompt_tokens=2_000)
    decision = await engine.route(request, replicas, "expected-ttft")
    assert decision.replica == expected


def test_calibration_moves_prefill_speed_toward_observed_ttft() -> None:
    scorer = at_now()
    replica = rep("a", running=0)
    request = req(request_id="cal-0")
    assert scorer.estimate(request, replica, NOW).expected_ttft_ms == pytest.approx(200.0)
    predictions = []
    for i in range(30):
        request = req(request_id=f"cal-{i}")
        scorer.score_with_terms(request, [replica])
        scorer.on_request_start(request, ReplicaId("a"))
        # The engine is really half as fast as configured: 2000 tokens take 400 ms.
        scorer.on_request_complete(request, ReplicaId("a"), 400.0, 0, True)
        predictions.append(scorer.estimate(request, replica, NOW).expected_ttft_ms)
    assert all(a < b for a, b in itertools.pairwise(predictions))
    assert predictions[-1] == pytest.approx(400.0, rel=0.01)
    assert scorer.calibrated_speed(ReplicaId("a")) == pytest.approx(5_000.0, rel=0.01)


def test_calibration_subtracts_the_predicted_queue_and_uses_engine_cached_tokens() -> None:
    scorer = at_now(ExpectedTtftScorer.Params(calibration_alpha=1.0))
    replica = rep("a", inflight_prefill_tokens=3_000)  # 300 ms predicted queue
    request = req(request_id="q")
    scorer.score_with_terms(request, [replica])
    # The engine reports 1000 cached tokens: 1000 uncached took 700 - 300 = 400 ms -> 2500 tok/s.
    scorer.on_request_complete(request, ReplicaId("a"), 700.0, 1_000, True)
    assert scorer.calibrated_speed(ReplicaId("a")) == pytest.approx(2_500.0)


@pytest.mark.parametrize(
    ("ttft_ms", "ok", "known"),
    [(None, True, True), (400.0, False, True), (400.0, True, False)],
)
def test_failed_unknown_or_untimed_requests_do_not_calibrate(
    ttft_ms: float | None, ok: bool, known: bool
) -> None:
    scorer = at_now()
    request = req(request_id="x")
    if known:
        scorer.score_with_terms(request, [rep("a")])
    scorer.on_request_complete(request, ReplicaId("a"), ttft_ms, 0, ok)
    assert scorer.calibrated_speed(ReplicaId("a")) is None


def test_one_outlier_moves_speed_by_a_bounded_step() -> None:
    params = ExpectedTtftScorer.Params(calibration_alpha=1.0, max_calibration_step=4.0)
    scorer = at_now(params)
    request = req(request_id="o")
    scorer.score_with_terms(request, [rep("a")])
    scorer.on_request_complete(request, ReplicaId("a"), 1_000_000.0, 0, True)
    assert scorer.calibrated_speed(ReplicaId("a")) == pytest.approx(2_500.0)


def test_cold_adapter_requests_calibrate_the_adapter_load_time() -> None:
    scorer = at_now(ExpectedTtftScorer.Params(calibration_alpha=0.5))
    request = req(request_id="ad", adapter="ad")
    scorer.score_with_terms(request, [rep("a")])
    # 200 ms prefill + 1300 ms observed load; the estimate moves half-way from 500 to 1300.
    scorer.on_request_complete(request, ReplicaId("a"), 1_500.0, 0, True)
    assert scorer.adapter_cold_load_estimate_ms("ad") == pytest.approx(900.0)
    assert scorer.calibrated_speed(ReplicaId("a")) is None


async def test_engine_forwards_outcomes_to_the_scorer() -> None:
    prof = profile()
    engine = RoutingEngine(None, {prof.name: prof})
    request = req(request_id="e", prefix_matches={})
    decision = await engine.route(request, [rep("a")], prof.name)
    engine.observe_start(request, decision.replica)
    engine.observe_complete(request, decision.replica, 400.0, 0, True)
    scorer = prof.scorers[0][0]
    assert isinstance(scorer, ExpectedTtftScorer)
    # EWMA with alpha 0.2 from 10000 toward the observed 5000 tok/s.
    assert scorer.calibrated_speed(ReplicaId("a")) == pytest.approx(9_000.0)
