"""``expected-ttft``: the cost terms, the choice they lead to, and online calibration."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.contracts import RoutingRequest
from routing.engine import Profile, RoutingEngine
from routing.policies.expected_ttft import TIE_TOLERANCE, ExpectedTtftScorer
from routing.policies.max_score import MaxScorePicker
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId
from tests.unit.test_policy_hot_prefix import REPLICAS, REQUESTS, expected_ttft, route_hot_prefix

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
    # LoRA slots (--max-loras): the adapter waits while no slot is left for it.
    pytest.param({"max_loras": 2, "running_adapters": frozenset({"x", "y"}), "running": 2},
                 {"adapter": "ad"}, {"adapter_slot_wait_ms": 1_000.0}, id="slots all held"),
    pytest.param({"max_loras": 2, "running_adapters": frozenset({"x", "y"}), "running": 6},
                 {"adapter": "ad"}, {"adapter_slot_wait_ms": 1_000.0},
                 id="slots held: requests the scorer did not send count as one per holder"),
    pytest.param({"max_loras": 2, "running_adapters": frozenset({"x", "y"}), "running": 2,
                  "waiting_adapters": frozenset({"x", "y", "z", "w", "ad"})}, {"adapter": "ad"},
                 {"adapter_slot_wait_ms": 1_500.0},
                 id="slots held, two adapters wait ahead: a second round of releases"),
    pytest.param({"max_loras": 3, "running_adapters": frozenset({"x", "y"}),
                  "waiting_adapters": frozenset({"z", "w"})}, {"adapter": "ad"},
                 {"adapter_slot_wait_ms": 1_000.0},
                 id="a slot free, but two adapters wait ahead for it"),
    pytest.param({"max_loras": 2, "waiting_adapters": frozenset({"z", "w", "v"})},
                 {"adapter": "ad"}, {"adapter_slot_wait_ms": 1_500.0},
                 id="no slot held, more adapters waiting than slots"),
    pytest.param({"max_loras": 2, "running_adapters": frozenset({"x", "ad"})}, {"adapter": "ad"},
                 {"adapter_slot_wait_ms": 0.0}, id="adapter running: joins its slot"),
    pytest.param({"max_loras": 3, "running_adapters": frozenset({"x", "y"})}, {"adapter": "ad"},
                 {"adapter_slot_wait_ms": 0.0}, id="a slot free"),
    pytest.param({"running_adapters": frozenset({"x", "y"})}, {"adapter": "ad"},
                 {"adapter_slot_wait_ms": 0.0}, id="slot count unknown"),
    pytest.param({"max_loras": 1, "running_adapters": frozenset({"x"})}, {},
                 {"adapter_slot_wait_ms": 0.0}, id="base model needs no slot"),
    pytest.param({"kv_usage": 0.85}, {}, {"kv_penalty_ms": 0.0}, id="kv below knee"),
    pytest.param({"kv_usage": 0.95}, {}, {"kv_penalty_ms": 500.0}, id="kv half-way past knee"),
    pytest.param({"kv_usage": 1.0}, {}, {"kv_penalty_ms": 2_000.0}, id="kv full"),
    # The gauge less the share of its running requests that ended since the reading.
    pytest.param({"kv_usage": 1.0, "running": 20, "finished_since_read": 1}, {},
                 {"kv_penalty_ms": 500.0}, id="kv full at the reading, 1 of 20 ended since"),
    pytest.param({"kv_usage": 0.93, "running": 4, "finished_since_read": 4}, {},
                 {"kv_penalty_ms": 0.0}, id="kv read during a burst that has ended"),
    pytest.param({"metrics_read_at": NOW - 1.5}, {}, {"stale_penalty_ms": 0.0}, id="fresh"),
    pytest.param({"metrics_read_at": NOW - 3.9}, {}, {"stale_penalty_ms": 0.0},
                 id="one poll cycle old (2 s interval + a slow poll): not stale"),
    pytest.param({"metrics_read_at": NOW - 12}, {}, {"stale_penalty_ms": 700.0}, id="stale"),
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
    parts = ("queue_wait_ms", "prefill_ms", "adapter_cold_load_ms", "adapter_slot_wait_ms",
             "kv_penalty_ms", "stale_penalty_ms")
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
    replica = rep("a", inflight_prefill_tokens=500)  # 50 ms predicted queue
    request = req(request_id="q")
    scorer.score_with_terms(request, [replica])
    # The engine reports 1000 cached tokens: 1000 uncached took 450 - 50 = 400 ms -> 2500 tok/s.
    scorer.on_request_complete(request, ReplicaId("a"), 450.0, 1_000, True)
    assert scorer.calibrated_speed(ReplicaId("a")) == pytest.approx(2_500.0)


@pytest.mark.parametrize(
    ("queued_tokens", "ttft_ms", "share", "calibrated"),
    [
        # 300 ms of queue before 200 ms of prefill: mostly queue, learns no speed.
        pytest.param(3_000, 700.0, 0.5, None, id="mostly queue"),
        # 100 ms of queue before 200 ms of prefill: 900 - 100 ms for 2000 tokens.
        pytest.param(1_000, 900.0, 0.5, 2_500.0, id="mostly prefill"),
        # Gate off: the queue model's error is learned as speed (700 - 300 ms for 2000 tokens).
        pytest.param(3_000, 700.0, None, 5_000.0, id="gate off"),
    ],
)
def test_a_request_that_mostly_queued_does_not_calibrate_speed(
    queued_tokens: int, ttft_ms: float, share: float | None, calibrated: float | None
) -> None:
    params = ExpectedTtftScorer.Params(calibration_alpha=1.0, max_calibration_queue_share=share)
    scorer = at_now(params)
    request = req(request_id="q")
    scorer.score_with_terms(request, [rep("a", inflight_prefill_tokens=queued_tokens)])
    scorer.on_request_complete(request, ReplicaId("a"), ttft_ms, 0, True)
    speed = scorer.calibrated_speed(ReplicaId("a"))
    assert speed == (None if calibrated is None else pytest.approx(calibrated))


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
    # 200 ms prefill + 1300 ms observed load; the estimate moves half-way from 500 to 1300, in
    # log space (to their geometric mean).
    scorer.on_request_complete(request, ReplicaId("a"), 1_500.0, 0, True)
    assert scorer.adapter_cold_load_estimate_ms("ad") == pytest.approx((500.0 * 1300.0) ** 0.5)
    assert scorer.calibrated_speed(ReplicaId("a")) is None


def test_one_absurd_adapter_load_moves_the_estimate_by_a_bounded_step() -> None:
    # A 10-minute TTFT (a stall, a restart) used to pull the estimate to two minutes; every
    # later request then avoided cold replicas, so nothing ever corrected it.
    params = ExpectedTtftScorer.Params(calibration_alpha=1.0, max_calibration_step=4.0)
    scorer = at_now(params)
    request = req(request_id="ad", adapter="ad")
    scorer.score_with_terms(request, [rep("a")])
    scorer.on_request_complete(request, ReplicaId("a"), 600_000.0, 0, True)
    assert scorer.adapter_cold_load_estimate_ms("ad") == pytest.approx(500.0 * 4.0)


async def test_engine_forwards_outcomes_to_the_scorer() -> None:
    prof = profile()
    engine = RoutingEngine(None, {prof.name: prof})
    request = req(request_id="e", prefix_matches={})
    decision = await engine.route(request, [rep("a")], prof.name)
    engine.observe_start(request, decision.replica)
    engine.observe_complete(request, decision.replica, 400.0, 0, True)
    scorer = prof.scorers[0][0]
    assert isinstance(scorer, ExpectedTtftScorer)
    # Log-space EWMA with alpha 0.2 from 10000 toward the observed 5000 tok/s.
    assert scorer.calibrated_speed(ReplicaId("a")) == pytest.approx(10_000.0 * 0.5**0.2)


# --------------------------------------------------------------------------- calibration


def observe_ratios(scorer: ExpectedTtftScorer, ratios: dict[str, list[float]]) -> None:
    """Feed each replica's TTFTs implying ``ratio`` x the configured 10,000 tok/s (2,000 tokens)."""
    replicas = [rep(rid) for rid in ratios]
    rounds = max(len(values) for values in ratios.values())
    for i in range(rounds):
        for rid, values in ratios.items():
            if i >= len(values):
                continue
            request = req(request_id=f"{rid}-{i}")
            scorer.score_with_terms(request, replicas)
            scorer.on_request_start(request, ReplicaId(rid))
            scorer.on_request_complete(request, ReplicaId(rid), 200.0 / values[i], 0, True)


NOISE = [1.3, 0.75, 1.1, 0.85, 1.2, 0.8, 1.0, 0.9, 1.15, 0.95] * 4  # geometric mean ~1


# Each row: per replica, the speed ratios its requests imply; expected calibrated speed (tok/s).
CALIBRATION = [
    pytest.param(
        {"a": NOISE, "b": NOISE[3:] + NOISE[:3], "c": NOISE[6:] + NOISE[:6], "d": NOISE[::-1]},
        {"a": "pool", "b": "pool", "c": "pool", "d": "pool"},
        id="identical replicas, noisy: all share the pool speed",
    ),
    pytest.param(
        {"a": NOISE, "b": NOISE[::-1], "c": NOISE[5:] + NOISE[:5], "d": [0.5] * 40},
        {"a": "pool", "b": "pool", "c": "pool", "d": 5_000.0},
        id="one replica really half as fast: it keeps its own speed",
    ),
    pytest.param(
        {"a": [0.5] * 40, "b": [0.5] * 40}, {"a": 5_000.0, "b": 5_000.0},
        id="the whole pool slower: the pool factor moves",
    ),
]


@pytest.mark.parametrize(("ratios", "expected"), CALIBRATION)
def test_calibration_shrinks_replicas_toward_the_pool(
    ratios: dict[str, list[float]], expected: dict[str, float | str]
) -> None:
    scorer = at_now()
    observe_ratios(scorer, ratios)
    speeds = {rid: scorer.calibrated_speed(ReplicaId(rid)) for rid in ratios}
    pooled = [speeds[rid] for rid, want in expected.items() if want == "pool"]
    for rid, want in expected.items():
        if want == "pool":
            # Shrunk onto one shared figure: noise makes no replica look faster than another.
            assert speeds[rid] == pytest.approx(pooled[0], rel=0.02), rid
        else:
            assert speeds[rid] == pytest.approx(want, rel=0.1), rid


def test_replica_of_an_untrained_pool_member_uses_the_pool_speed() -> None:
    scorer = at_now()
    observe_ratios(scorer, {"a": [0.5] * 40})
    # "b" never completed a request, but it is in a's pool: same hardware, same speed.
    estimate = scorer.estimate(req(request_id="new"), rep("b"), NOW)
    assert estimate.prefill_tokens_per_s == pytest.approx(5_000.0, rel=0.01)


# --------------------------------------------------------------------------- backlog


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# Each row: seconds after dispatching 5,000 tokens (at 10,000 tok/s), the gateway's counter,
# the expected queue wait for the next request.
DRAIN = [
    pytest.param(0.0, 5_000, 500.0, id="just sent: all of it queued"),
    pytest.param(0.2, 5_000, 300.0, id="40% prefilled"),
    pytest.param(0.45, 5_000, 50.0, id="90% prefilled: nearly free"),
    pytest.param(1.0, 5_000, 0.0, id="overdue: no negative wait"),
    pytest.param(0.0, 1_000, 100.0, id="counter lower (first tokens came): it caps"),
]


@pytest.mark.parametrize(("elapsed_s", "counter", "queue_ms"), DRAIN)
def test_backlog_drains_with_elapsed_time(elapsed_s: float, counter: int, queue_ms: float) -> None:
    clock = FakeClock()
    scorer = ExpectedTtftScorer(
        ExpectedTtftScorer.Params(recent_prefill_weight=0.0),
        clock=lambda: NOW,
        elapsed_clock=clock,
    )
    first = req(request_id="first", prompt_tokens=5_000)
    scorer.score_with_terms(first, [rep("a")])
    scorer.on_request_start(first, ReplicaId("a"))
    clock.now += elapsed_s
    estimate = scorer.estimate(req(request_id="next"), rep("a", inflight_prefill_tokens=counter))
    assert estimate.queue_wait_ms == pytest.approx(queue_ms)


def test_backlog_not_sent_from_here_is_not_aged() -> None:
    clock = FakeClock()
    scorer = ExpectedTtftScorer(clock=lambda: NOW, elapsed_clock=clock)
    clock.now += 10.0
    # Another gateway's 5,000 tokens: no dispatch time to age from, counted in full.
    estimate = scorer.estimate(req(), rep("a", inflight_prefill_tokens=5_000))
    assert estimate.queue_wait_ms == pytest.approx(500.0)


def test_bind_elapsed_clock_replaces_the_drain_clock() -> None:
    wall = FakeClock()
    virtual = FakeClock()
    scorer = ExpectedTtftScorer(
        ExpectedTtftScorer.Params(recent_prefill_weight=0.0), clock=lambda: NOW, elapsed_clock=wall
    )
    scorer.bind_elapsed_clock(virtual)
    first = req(request_id="first", prompt_tokens=5_000)
    scorer.score_with_terms(first, [rep("a")])
    scorer.on_request_start(first, ReplicaId("a"))
    wall.now += 1.0  # the wall clock no longer counts
    busy = rep("a", inflight_prefill_tokens=5_000)
    assert scorer.estimate(req(request_id="n1"), busy).queue_wait_ms == pytest.approx(500.0)
    virtual.now += 0.25
    assert scorer.estimate(req(request_id="n2"), busy).queue_wait_ms == pytest.approx(250.0)


# --------------------------------------------------------------------------- decode interference


# Each row: seconds since 2,000 tokens (200 ms of prefill) were sent; running decodes there;
# expected decode_interference_ms at the default weight 0.05 and window 2 s.
INTERFERENCE = [
    pytest.param(0.0, 10, 0.05 * 200.0, id="just prefilled 200 ms: 10 ms"),
    pytest.param(2.0, 10, 0.05 * 200.0 / math.e, id="one window later: decayed by e"),
    pytest.param(0.0, 0, 0.0, id="no running decodes: nobody to stall"),
]


@pytest.mark.parametrize(("elapsed_s", "running", "expected_ms"), INTERFERENCE)
def test_recent_prefill_costs_decode_interference(
    elapsed_s: float, running: int, expected_ms: float
) -> None:
    clock = FakeClock()
    scorer = ExpectedTtftScorer(clock=lambda: NOW, elapsed_clock=clock)
    first = req(request_id="first")
    scorer.score_with_terms(first, [rep("a")])
    scorer.on_request_start(first, ReplicaId("a"))
    clock.now += elapsed_s
    estimate = scorer.estimate(req(request_id="next"), rep("a", running=running))
    assert estimate.decode_interference_ms == pytest.approx(expected_ms)
    # It steers the choice but is not part of the TTFT.
    assert estimate.cost_ms == pytest.approx(estimate.expected_ttft_ms + expected_ms)


async def test_recent_prefill_spreads_equal_choices() -> None:
    clock = FakeClock()
    scorer = ExpectedTtftScorer(clock=lambda: NOW, elapsed_clock=clock)
    picker = MaxScorePicker(MaxScorePicker.Params(tie_tolerance=0))
    prof = Profile("p", (), ((scorer, 1.0),), picker)
    engine = RoutingEngine(None, {"p": prof})
    replicas = [rep("a", running=20), rep("b", running=20)]
    first = req(request_id="first", prefix_matches={})
    decision = await engine.route(first, replicas, "p")
    engine.observe_start(first, decision.replica)
    clock.now += 1.0  # its prefill is done (backlog drained), its decodes' stall is recent
    second = await engine.route(req(request_id="second", prefix_matches={}), replicas, "p")
    assert second.replica != decision.replica


async def test_builtin_profile_still_spreads_a_hot_prefix() -> None:
    """The built-in profile's tighter tie tolerance (1%) keeps the hot-prefix guard working."""
    picker = MaxScorePicker(MaxScorePicker.Params(tie_tolerance=TIE_TOLERANCE))
    counts = await route_hot_prefix(expected_ttft(picker))
    assert counts.most_common(1)[0][1] <= 0.3 * REQUESTS
    assert len(counts) >= REPLICAS // 2


def test_a_retry_on_a_fallback_replica_counts_its_backlog_there() -> None:
    clock = FakeClock()
    scorer = ExpectedTtftScorer(
        ExpectedTtftScorer.Params(recent_prefill_weight=0.0), clock=lambda: NOW, elapsed_clock=clock
    )
    request = req(request_id="retry", prompt_tokens=5_000, prefix_matches={})
    scorer.score_with_terms(request, [rep("a"), rep("b")])
    scorer.on_request_start(request, ReplicaId("a"))  # keeps only a's prediction
    scorer.on_request_start(request, ReplicaId("b"))  # a failed: the gateway retries on b
    clock.now += 0.1
    busy_b = rep("b", inflight_prefill_tokens=5_000)
    assert scorer.estimate(req(request_id="n"), busy_b).queue_wait_ms == pytest.approx(400.0)


def test_an_adapter_sent_since_the_engine_was_read_holds_a_slot() -> None:
    clock = [NOW]
    scorer = ExpectedTtftScorer(clock=lambda: clock[0])
    read = rep(max_loras=1, metrics_read_at=NOW)  # no adapter running when last read
    first = req(request_id="first", adapter="p")
    scorer.score_with_terms(first, [read])
    clock[0] = NOW + 0.1
    scorer.on_request_start(first, ReplicaId("a"))  # runs at once: holds the one slot
    assert scorer.estimate(req(adapter="q"), read).adapter_slot_wait_ms == 1_000.0
    assert scorer.estimate(req(adapter="p"), read).adapter_slot_wait_ms == 0.0
    # Read after it was sent, the engine's own figures say who holds the slot.
    fresh = rep(max_loras=1, metrics_read_at=NOW + 0.2)
    assert scorer.estimate(req(adapter="q"), fresh).adapter_slot_wait_ms == 0.0


def test_an_adapter_whose_last_request_ended_holds_no_slot_until_the_next_reading() -> None:
    # Kept until the engine's next figures (a health interval live), a finished request's slot
    # charged a wait on an idle replica and sent its adapter to a cold one instead.
    clock = [NOW]
    scorer = ExpectedTtftScorer(clock=lambda: clock[0])
    read = rep(max_loras=1, metrics_read_at=NOW)
    first, second = req(request_id="first", adapter="p"), req(request_id="second", adapter="p")
    for request in (first, second):
        scorer.score_with_terms(request, [read])
    clock[0] = NOW + 0.1
    scorer.on_request_start(first, ReplicaId("a"))
    scorer.on_request_start(second, ReplicaId("a"))
    scorer.on_request_complete(first, ReplicaId("a"), None, None, True)
    # One of p's requests is still running there: p still holds the slot.
    assert scorer.estimate(req(adapter="q"), read).adapter_slot_wait_ms == 1_000.0
    scorer.on_request_complete(second, ReplicaId("a"), None, None, True)
    assert scorer.estimate(req(adapter="q"), read).adapter_slot_wait_ms == 0.0
    # A request retried on another replica leaves its slot on the first one as well.
    third = req(request_id="third", adapter="p")
    scorer.score_with_terms(third, [read, rep("b", max_loras=1, metrics_read_at=NOW)])
    scorer.on_request_start(third, ReplicaId("a"))
    assert scorer.estimate(req(adapter="q"), read).adapter_slot_wait_ms == 1_000.0
    scorer.on_request_start(third, ReplicaId("b"))  # a failed: the gateway retries on b
    assert scorer.estimate(req(adapter="q"), read).adapter_slot_wait_ms == 0.0


def test_a_request_that_waited_for_a_slot_calibrates_the_wait_not_the_speed() -> None:
    scorer = at_now()
    held = rep(max_loras=1, running_adapters=frozenset({"x"}))
    for i in range(30):
        request = req(request_id=f"r{i}", adapter="ad",
                      adapter_cold_load_ms={ReplicaId("a"): 0.0})
        scorer.score_with_terms(request, [held])
        scorer.on_request_start(request, ReplicaId("a"))
        # 200 ms of prefill (2,000 uncached tokens at 10k/s) after a 4 s wait for the slot.
        scorer.on_request_complete(request, ReplicaId("a"), 4_200.0, 0, True)
    assert scorer.adapter_slot_wait_estimate_ms == pytest.approx(4_000.0, rel=0.01)
    assert scorer.calibrated_speed(ReplicaId("a")) is None
    # A wait shorter than predicted brings it down again, at most 4-fold per request.
    request = req(request_id="short", adapter="ad", adapter_cold_load_ms={ReplicaId("a"): 0.0})
    scorer.score_with_terms(request, [held])
    scorer.on_request_start(request, ReplicaId("a"))
    scorer.on_request_complete(request, ReplicaId("a"), 200.0, 0, True)
    assert scorer.adapter_slot_wait_estimate_ms == pytest.approx(4_000.0 * 4 ** -0.2, rel=0.01)


def test_the_slot_that_frees_first_is_the_holder_with_the_fewest_requests_in_flight() -> None:
    scorer = at_now()
    held = rep(max_loras=2, running_adapters=frozenset({"x", "y"}))
    sent = [("x", 3), ("y", 2)]
    for adapter, count in sent:
        for i in range(count):
            request = req(request_id=f"{adapter}{i}", adapter=adapter)
            scorer.score_with_terms(request, [held])
            scorer.on_request_start(request, ReplicaId("a"))
    assert scorer.estimate(req(adapter="ad"), held).adapter_slot_wait_ms == 2_000.0
    # One adapter waiting ahead takes y's slot: this one waits for x's three requests.
    queued = rep(max_loras=2, running_adapters=frozenset({"x", "y"}),
                 waiting_adapters=frozenset({"z"}))
    assert scorer.estimate(req(adapter="ad"), queued).adapter_slot_wait_ms == 3_000.0
    # y's requests finish (one of them failed: it leaves all the same): y's slot frees first.
    scorer.on_request_complete(req(request_id="y0", adapter="y"), ReplicaId("a"), 100.0, 0, True)
    scorer.on_request_complete(req(request_id="y1", adapter="y"), ReplicaId("a"), None, 0, False)
    assert scorer.estimate(req(adapter="ad"), held).adapter_slot_wait_ms == 1_000.0


ADAPTERS = st.sets(st.sampled_from(["ad", "p", "q", "r", "s", "t"]), max_size=6)


@given(limit=st.integers(1, 4), running=ADAPTERS, waiting=ADAPTERS,
       sent=st.lists(st.sampled_from(["p", "q", "r", "s", "t"]), max_size=8))
def test_the_slot_wait_is_defined_for_any_slot_state(
    limit: int, running: set[str], waiting: set[str], sent: list[str]
) -> None:
    """Whatever the engine reports (sets that disagree, more waiting than slots, nothing
    running), the wait is a finite figure, 0 once the adapter holds a slot, and never shorter
    with more adapters waiting ahead."""
    scorer = at_now()
    state = rep(max_loras=limit, running_adapters=frozenset(running),
                waiting_adapters=frozenset(waiting))
    for i, adapter in enumerate(sent):
        request = req(request_id=f"s{i}", adapter=adapter)
        scorer.score_with_terms(request, [state])
        scorer.on_request_start(request, ReplicaId("a"))
    wait = scorer.estimate(req(adapter="ad"), state).adapter_slot_wait_ms
    assert math.isfinite(wait) and wait >= 0.0
    if "ad" in running:
        assert wait == 0.0
    more = rep(max_loras=limit, running_adapters=frozenset(running),
               waiting_adapters=frozenset(waiting | {"x1", "x2"}))
    assert scorer.estimate(req(adapter="ad"), more).adapter_slot_wait_ms >= wait


def test_many_waits_in_flight_move_the_estimate_to_what_they_waited_not_beyond() -> None:
    """Completions of requests routed on an older estimate still pull toward what they waited."""
    scorer = at_now()
    held = rep(max_loras=2, running_adapters=frozenset({"x", "y"}), running=2,
               waiting_adapters=frozenset({"z", "w"}))  # a second round: 1.5 x the estimate
    requests = [req(request_id=f"r{i}", adapter="ad", adapter_cold_load_ms={ReplicaId("a"): 0.0})
                for i in range(60)]
    for request in requests:  # all routed before any completes
        scorer.score_with_terms(request, [held])
        scorer.on_request_start(request, ReplicaId("a"))
    for request in requests:  # each waited 1.5 x 3 s for its slot, then prefilled 200 ms
        scorer.on_request_complete(request, ReplicaId("a"), 4_700.0, 0, True)
    assert scorer.adapter_slot_wait_estimate_ms == pytest.approx(3_000.0, rel=0.01)


def test_learned_speed_stays_within_ten_times_the_configured() -> None:
    # TTFTs that read as instant (sixty 0 ms answers) pushed the speed towards infinity: prefill
    # then cost nothing and every later observation was filtered out as queue time.
    from routing.policies.calibration import MAX_FACTOR, SpeedCalibration

    calibration = SpeedCalibration(alpha=0.5, max_step=4.0)
    for _ in range(60):
        calibration.observe(ReplicaId("a"), "p", 1e12)
    assert calibration.factor(ReplicaId("a")) == pytest.approx(MAX_FACTOR, rel=1e-3)
    for _ in range(60):
        calibration.observe(ReplicaId("a"), "p", 1e-12)
    assert calibration.factor(ReplicaId("a")) == pytest.approx(1 / MAX_FACTOR, rel=1e-3)


def test_a_cost_that_is_not_a_number_scores_zero_and_leaves_the_others_alone() -> None:
    from routing.policies.expected_ttft import relative_scores

    a, b, c = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
    assert relative_scores({a: math.nan, b: 100.0, c: 200.0}) == {a: 0.0, b: 1.0, c: 0.5}
    assert relative_scores({a: math.inf, b: math.inf}) == {a: 1.0, b: 1.0}
    assert relative_scores({a: math.inf, b: 50.0}) == {a: 0.0, b: 1.0}


def test_an_absurd_waiting_count_costs_infinity_instead_of_failing_the_scorer() -> None:
    """The routing review of session 46: a count past about 3.5e305 overflowed the exact
    integer division, the scorer failed, and routing ignored it for the whole fleet."""
    scorer = at_now()
    estimate = scorer.estimate(req(), rep("garbage", waiting=10**306), NOW)
    assert estimate.expected_ttft_ms == math.inf
    assert math.isfinite(scorer.estimate(req(), rep("sane", waiting=3), NOW).expected_ttft_ms)
