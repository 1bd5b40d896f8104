"""``fleet-cost``: its terms, its choices at light and heavy load, and hot-prefix spread."""

from __future__ import annotations

import math
from typing import Any

import pytest

from routing.contracts import RoutingRequest
from routing.engine import Profile, RoutingEngine
from routing.policies.fleet_cost import (
    TIE_TOLERANCE,
    ArrivalRate,
    DecayedShare,
    FleetCostScorer,
    RunningQuantile,
)
from routing.policies.max_score import MaxScorePicker
from routing.policies.registry import builtin_profile
from routing.state import ReplicaState
from routing.types import BlockHash, Epoch, ReplicaId
from tests.unit.test_policy_hot_prefix import REPLICAS, REQUESTS, route_hot_prefix

NOW = 1_000_000.0


class _Clock:
    """A settable elapsed clock (the backlog drain and the arrival rate read it)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scorer(clock: _Clock | None = None, **params: Any) -> FleetCostScorer:
    """A scorer whose wall clock reads ``NOW`` (fresh replica figures), elapsed time frozen."""
    return FleetCostScorer(
        FleetCostScorer.Params(**params),
        clock=lambda: NOW,
        elapsed_clock=clock or _Clock(),
    )


def profile(**params: Any) -> Profile:
    return Profile(
        "fleet-cost",
        (),
        ((scorer(**params), 1.0),),
        MaxScorePicker(MaxScorePicker.Params(tie_tolerance=TIE_TOLERANCE)),
    )


def rep(rid: str, **fields: Any) -> ReplicaState:
    fields.setdefault("models", frozenset({"m"}))
    fields.setdefault("metrics_read_at", NOW)
    fields.setdefault("prefill_tokens_per_s", 10_000.0)
    fields.setdefault("decode_step_ms", 30.0)
    return ReplicaState(replica_id=ReplicaId(rid), url=f"http://{rid}", **fields)


def req(**fields: Any) -> RoutingRequest:
    values: dict[str, Any] = {
        "request_id": "r",
        "model": "m",
        "adapter": None,
        "tenant": "t",
        "route": "d",
        "prompt_tokens": 2_000,
        "chain": [BlockHash(i) for i in range(125)],
        "seed": 1,
    }
    values.update(fields)
    return RoutingRequest(**values)


# --------------------------------------------------------------------------- terms

#: No externality terms and no free queue depth: each row switches on the one it shows.
QUIET = {
    "decode_weight": 0.0,
    "queue_weight": 0.0,
    "evict_weight": 0.0,
    "duplicate_free_depth": 0.0,
}

TERMS = [
    pytest.param(
        {},
        [rep("holder"), rep("cold")],
        {"holder": 100},
        {
            "holder": {"duplicate_ms": 0.0, "duplicate_weight": 0.0},
            "cold": {"duplicate_ms": 160.0, "duplicate_weight": 0.0, "fleet_cost_ms": 200.0},
        },
        id="duplicate: 1600 tokens the holder would skip; idle fleet: only its own TTFT counts",
    ),
    pytest.param(
        {"duplicate_base": 1.0, "duplicate_per_queued": 0.5},
        [rep("holder", waiting=8), rep("cold", waiting=4)],
        {"holder": 100},
        # cold: 4 waiting x 512 tokens = 204.8 ms queue, 200 ms prefill, 160 ms of it duplicated
        {"cold": {"duplicate_weight": 1.0 + 0.5 * 6, "fleet_cost_ms": 204.8 + 200.0 + 4.0 * 160.0}},
        id="duplicate weight grows with the fleet's mean queue (6 waiting)",
    ),
    pytest.param(
        {"duplicate_base": 1.0, "duplicate_per_queued": 1.0},
        [rep("a", inflight_requests=5, running=2), rep("b", inflight_requests=1, running=1)],
        {},
        {"a": {"duplicate_weight": 1.0 + 1.5}},
        id="gateway in-flight beyond running counts as queued (3 and 0)",
    ),
    pytest.param(
        {"duplicate_per_queued": 1.0, "duplicate_free_depth": 1.0},
        [rep("a", waiting=4), rep("b", waiting=4)],
        {"a": 100},
        {"b": {"duplicate_weight": 3.0}},
        id="the free depth costs nothing: weight from the 3 queued beyond it",
    ),
    pytest.param(
        {"duplicate_per_queued": 1.0},
        [rep("fast", waiting=4), rep("slow", waiting=4, prefill_tokens_per_s=5_000.0)],
        {},
        {"fast": {"duplicate_ms": 0.0}, "slow": {"duplicate_ms": 0.0, "prefill_ms": 400.0}},
        id="a slower replica does no duplicate work: nothing is cached anywhere",
    ),
    pytest.param(
        {"decode_weight": 0.1, "decode_free_duty": None},
        [rep("busy", running=20), rep("idle")],
        {},
        {"busy": {"externality_ms": 200.0 * 0.1 * 20}, "idle": {"externality_ms": 0.0}},
        id="decodes stalled by this prefill",
    ),
    pytest.param(
        {"evict_weight": 1.0},
        [
            rep("full holder", kv_capacity_blocks=200, cached_blocks=200),
            rep("cold", kv_capacity_blocks=200, cached_blocks=0),
        ],
        {"full holder": 100},
        {"full holder": {"eviction_ms": 0.0}, "cold": {"eviction_ms": 0.0}},
        id="a full holder is not pushed onto an emptier cache (that would duplicate its prefix)",
    ),
    pytest.param(
        {"evict_weight": 1.0},
        [
            rep("a", kv_capacity_blocks=200, cached_blocks=200),
            rep("b", kv_capacity_blocks=200, cached_blocks=200),
            rep("unknown", cached_blocks=5),
        ],
        {},
        {"a": {"eviction_ms": 0.0}, "b": {"eviction_ms": 0.0}, "unknown": {"eviction_ms": 0.0}},
        id="every cache full (steady state), or capacity unknown: no eviction charge",
    ),
]


@pytest.mark.parametrize(("params", "replicas", "matches", "expected"), TERMS)
def test_cost_terms(
    params: dict[str, Any],
    replicas: list[ReplicaState],
    matches: dict[str, int],
    expected: dict[str, dict[str, float]],
) -> None:
    s = scorer(**{**QUIET, **params})
    request = req(prefix_matches={ReplicaId(k): v for k, v in matches.items()})
    _, terms = s.score_with_terms(request, replicas)
    for rid, values in expected.items():
        for name, value in values.items():
            assert terms[ReplicaId(rid)][name] == pytest.approx(value), (rid, name)
    for rid in terms:
        t = terms[rid]
        total = (
            t["cost_ms"]
            + t["duplicate_weight"] * t["duplicate_ms"]
            + t["externality_ms"]
            + t["eviction_ms"]
            + t["fragile_ms"]
        )
        assert t["fleet_cost_ms"] == pytest.approx(total)


def test_scores_are_relative_fleet_cost_with_a_floor() -> None:
    s = scorer(**QUIET, cost_floor_ms=10.0)
    replicas = [rep("fast"), rep("slow", inflight_prefill_tokens=4_000)]
    scores, terms = s.score_with_terms(req(), replicas)
    # fast: 200 ms, slow: 400 + 200 ms (nothing cached anywhere: no duplicate work)
    assert scores == {"fast": 1.0, "slow": pytest.approx(210 / 610)}
    assert terms[ReplicaId("slow")]["duplicate_ms"] == 0.0


# --------------------------------------------------------------------------- decisions


# The holder has 100 of the 125 blocks (saves 160 ms of prefill) and a longer queue than the
# other replicas. Rows: how many requests wait on every replica (the fleet's congestion), the
# holder's extra prefill backlog in tokens, and where the request should go.
STICKY = [
    pytest.param(0, 3_000, "idle-1", id="idle fleet: a 300 ms queue is not worth 160 ms"),
    pytest.param(0, 1_000, "holder", id="idle fleet: a 100 ms queue is"),
    pytest.param(8, 3_000, "holder", id="congested fleet: duplicated prefill costs everyone"),
    pytest.param(8, 12_000, "holder", id="congested fleet: sticky well past the ttft break-even"),
    pytest.param(8, 60_000, "idle-1", id="congested fleet: a 6 s hole is still too deep"),
]


@pytest.mark.parametrize(("waiting", "holder_backlog", "expected"), STICKY)
async def test_sticky_until_the_holder_is_far_behind(
    waiting: int, holder_backlog: int, expected: str
) -> None:
    engine = RoutingEngine(
        None, {"fleet-cost": profile(**QUIET, duplicate_base=0.0, duplicate_per_queued=1.0)}
    )
    # Engine-reported waiting requests count 512 tokens each in the queue estimate; the holder's
    # own backlog comes on top through the gateway's in-flight prefill counter.
    replicas = [
        rep("holder", waiting=waiting, inflight_prefill_tokens=waiting * 512 + holder_backlog),
        rep("idle-1", waiting=waiting),
        rep("idle-2", waiting=waiting, inflight_prefill_tokens=waiting * 512 + 1_000),
    ]
    request = req(prefix_matches={ReplicaId("holder"): 100})
    decision = await engine.route(request, replicas, "fleet-cost")
    assert decision.replica == expected


async def test_expected_ttft_would_leave_the_holder_where_fleet_cost_stays() -> None:
    """The difference in one row: same state, the stock policy chases the shorter queue."""
    replicas = [
        rep("holder", waiting=8, inflight_prefill_tokens=8 * 512 + 3_000),
        rep("idle-1", waiting=8),
    ]
    request = req(prefix_matches={ReplicaId("holder"): 100})
    ours = await RoutingEngine(None, {"fleet-cost": profile(**QUIET, duplicate_base=0.0)}).route(
        request, replicas, "fleet-cost"
    )
    theirs = await RoutingEngine(None, {"expected-ttft": builtin_profile("expected-ttft")}).route(
        req(prefix_matches={ReplicaId("holder"): 100}), replicas, "expected-ttft"
    )
    assert (ours.replica, theirs.replica) == ("holder", "idle-1")


async def test_a_cold_prompt_avoids_stalling_many_decodes() -> None:
    engine = RoutingEngine(
        None, {"fleet-cost": profile(**{**QUIET, "decode_weight": 0.1, "decode_free_duty": None})}
    )
    replicas = [rep("busy", running=40), rep("calm", running=2, inflight_prefill_tokens=500)]
    decision = await engine.route(req(), replicas, "fleet-cost")
    # busy: 200 ms prefill + 40 x 30 x 0.05 contention + 200 x 0.1 x 40 externality;
    # calm: 50 ms queue + 200 ms + small terms.
    assert decision.replica == "calm"


async def test_by_default_a_long_prefill_goes_where_it_stalls_fewer_decodes() -> None:
    """Default parameters: a 2 s cold prefill on a replica that spent 80% of the last moments
    prefilling and runs 40 decodes would stall each of them 2 s when they have no TPOT slack
    left; a replica with 25 decodes, no recent prefill and 300 ms more queue is the cheaper home.
    ``expected-ttft``, which prices only the request's own first token, takes the shorter queue.
    """
    s = scorer()
    ours = RoutingEngine(
        None,
        {"fleet-cost": Profile("fleet-cost", (), ((s, 1.0),), MaxScorePicker())},
    )
    replicas = [
        rep("crowded", running=40),
        rep("quiet", running=25, inflight_prefill_tokens=3_000),
    ]
    # 1.6 s of prefill sent to "crowded" within the 2 s window (a duty cycle of 0.8), whose
    # first token has arrived since: the gateway's in-flight counter no longer holds it.
    earlier = req(request_id="earlier", prompt_tokens=16_000, chain=[])
    s.score_with_terms(earlier, replicas)
    s.on_request_start(earlier, ReplicaId("crowded"))
    long_prompt = {"prompt_tokens": 20_000, "chain": []}
    decision = await ours.route(req(**long_prompt), replicas, "fleet-cost")
    theirs = await RoutingEngine(None, {"expected-ttft": builtin_profile("expected-ttft")}).route(
        req(**long_prompt), replicas, "expected-ttft"
    )
    # crowded: 2,000 ms prefill + 60 contention + 80 recent-prefill interference, and
    # 0.09 x (0.8 - 0.4) / 0.6 = 0.06 of the prefill per decode: + 0.06 x 40 x 2,000 = 4,800;
    # quiet: 300 ms queue + 2,000 + 37.5 contention, duty 0: no decode charge.
    terms = decision.explanations[ReplicaId("crowded")].terms
    assert terms["externality_ms"] == pytest.approx(4_800.0)
    assert (decision.replica, theirs.replica) == ("quiet", "crowded")


def test_decodes_with_tpot_slack_are_not_charged() -> None:
    """Below ``decode_free_duty`` the decodes keep their TPOT whatever one more prefill does."""
    s = scorer(**{**QUIET, "decode_weight": 0.09, "decode_free_duty": 0.4})
    replicas = [rep("busy", running=40)]
    earlier = req(request_id="earlier", prompt_tokens=6_000, chain=[])  # 600 ms: duty 0.3
    s.score_with_terms(earlier, replicas)
    s.on_request_start(earlier, ReplicaId("busy"))
    _, terms = s.score_with_terms(req(), replicas)
    assert terms[ReplicaId("busy")]["externality_ms"] == 0.0


def _written_to(s: FleetCostScorer, replicas: list[ReplicaState], rid: str, tokens: int) -> None:
    """``tokens`` of a new prompt sent to ``rid`` (so the scorer dates that replica's cache)."""
    request = req(request_id=f"w-{rid}", prompt_tokens=tokens, chain=[])
    s.score_with_terms(request, replicas)
    s.on_request_start(request, ReplicaId(rid))


def test_eviction_is_charged_by_the_age_of_what_it_evicts() -> None:
    clock = _Clock()
    s = scorer(clock, **{**QUIET, "evict_weight": 1.0, "evict_horizon_s": 30.0})
    replicas = [
        rep("full", kv_capacity_blocks=200, cached_blocks=150),  # room 800 tokens
        rep("roomy", kv_capacity_blocks=200, cached_blocks=20),
    ]
    _written_to(s, replicas, "full", 300)  # room 500; its oldest content is this write
    clock.now = 30.0
    _, terms = s.score_with_terms(req(chain=[]), replicas)  # 2,000 new tokens
    # 1,500 tokens evicted there (150 ms of prefill), written one horizon ago: e^-1 of it.
    assert terms[ReplicaId("full")]["eviction_ms"] == pytest.approx(150.0 * math.exp(-1.0))
    assert terms[ReplicaId("roomy")]["eviction_ms"] == 0.0
    clock.now = 3000.0  # long unused: evicting it costs (next to) nothing
    _, terms = s.score_with_terms(req(request_id="later", chain=[]), replicas)
    assert terms[ReplicaId("full")]["eviction_ms"] == pytest.approx(0.0, abs=1e-9)


def test_no_eviction_charge_on_a_queueing_fleet() -> None:
    """Where requests queue, the queue decides where new content goes, not the caches' room."""
    s = scorer(**{**QUIET, "evict_weight": 1.0, "duplicate_per_queued": 1.0})

    def fleet(waiting: int) -> list[ReplicaState]:
        return [
            rep("full", kv_capacity_blocks=200, cached_blocks=150, waiting=waiting),
            rep("roomy", kv_capacity_blocks=200, cached_blocks=20, waiting=waiting),
        ]

    _written_to(s, fleet(0), "full", 300)
    _, idle = s.score_with_terms(req(chain=[]), fleet(0))
    _, queueing = s.score_with_terms(req(request_id="q", chain=[]), fleet(2))
    assert idle[ReplicaId("full")]["eviction_ms"] > 0
    assert queueing[ReplicaId("full")]["duplicate_weight"] == 2.0
    assert queueing[ReplicaId("full")]["eviction_ms"] == 0.0


def test_eviction_is_compared_only_among_equally_matched_replicas() -> None:
    s = scorer(**{**QUIET, "evict_weight": 1.0})
    replicas = [
        rep("full holder", kv_capacity_blocks=200, cached_blocks=200),
        rep("roomy holder", kv_capacity_blocks=200, cached_blocks=0),
        rep("cold", kv_capacity_blocks=200, cached_blocks=0),
    ]
    _written_to(s, replicas, "full holder", 100)
    matches = {ReplicaId("full holder"): 100, ReplicaId("roomy holder"): 100}
    _, terms = s.score_with_terms(req(prefix_matches=matches), replicas)
    # 400 new tokens on either holder: the full one evicts them all (40 ms, written just now);
    # cold, with room, evicts nothing: what it costs is duplicated prefill.
    assert terms[ReplicaId("full holder")]["eviction_ms"] == pytest.approx(40.0)
    assert terms[ReplicaId("roomy holder")]["eviction_ms"] == 0.0
    assert terms[ReplicaId("cold")]["eviction_ms"] == 0.0
    assert terms[ReplicaId("cold")]["duplicate_ms"] == pytest.approx(160.0)
    # Without a roomy holder, the full one is not charged for what cold would not evict.
    _, terms = s.score_with_terms(
        req(request_id="again", prefix_matches={ReplicaId("full holder"): 100}),
        [replicas[0], replicas[2]],
    )
    assert terms[ReplicaId("full holder")]["eviction_ms"] == 0.0


#: The weight docs/policies/fleet-cost.md measures (the term is off by default).
EVICT_WEIGHT = 1.0


def test_an_idle_replica_stops_taking_new_prefixes_once_its_cache_is_full() -> None:
    """The real-vLLM e2e prefix test's failure on a busy machine: one engine finished each
    request before the next decision, so by load it looked idle every time, and it took 7 of 8
    new 24-block prefixes into a 112-block cache. Its KV usage and its agent's last reading said
    0: only the blocks routing wrote there since show that the cache is full (with
    ``evict_weight`` on; it is off by default)."""
    clock = _Clock()
    s = scorer(clock, **{**QUIET, "evict_weight": EVICT_WEIGHT})
    taken: list[str] = []
    for n in range(8):
        clock.now += 0.13  # the decisions' spacing in that run
        replicas = [
            rep("idle", kv_capacity_blocks=112, cached_blocks=0),
            rep("busy", kv_capacity_blocks=112, cached_blocks=0, inflight_requests=1, running=1),
        ]
        request = req(request_id=f"p{n}", prompt_tokens=24 * 16 + 5, chain=[])
        scores, _ = s.score_with_terms(request, replicas)
        chosen = max(scores, key=lambda rid: scores[rid])
        s.on_request_start(request, chosen)
        s.on_request_complete(request, chosen, 50.0, 0, True)
        taken.append(chosen)
    assert taken.count("idle") == 4, " ".join(taken)  # 4 x 24 = 96 blocks fit; a fifth evicts 8
    assert taken[4:] == ["busy"] * 4


def test_a_new_epoch_empties_the_fill_estimate() -> None:
    s = scorer(**{**QUIET, "evict_weight": EVICT_WEIGHT})
    full = [rep("a", kv_capacity_blocks=24), rep("b", kv_capacity_blocks=24)]
    request = req(prompt_tokens=24 * 16, chain=[])
    s.score_with_terms(request, full)
    s.on_request_start(request, ReplicaId("a"))  # a's cache is now full
    _, terms = s.score_with_terms(req(request_id="next", prompt_tokens=24 * 16, chain=[]), full)
    assert terms[ReplicaId("a")]["eviction_ms"] > 0
    restarted = [rep("a", kv_capacity_blocks=24, epoch=Epoch(2)), full[1]]
    _, terms = s.score_with_terms(req(request_id="again", prompt_tokens=24 * 16), restarted)
    assert terms[ReplicaId("a")]["eviction_ms"] == 0.0


def test_the_old_kv_usage_threshold_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"evict_threshold is gone.*Remove it"):
        FleetCostScorer.Params(evict_threshold=0.8)


@pytest.mark.parametrize(("protect_weight", "expected"), [(0.0, "calm"), (0.2, "lost")])
async def test_protection_sends_new_prefill_where_decodes_are_lost_anyway(
    protect_weight: float, expected: str
) -> None:
    """``protect_weight`` (off by default): prefill stalls decodes only below ``protect_duty``."""
    s = scorer(**{**QUIET, "protect_weight": protect_weight, "protect_duty": 0.8})
    engine = RoutingEngine(
        None,
        {"fleet-cost": Profile("fleet-cost", (), ((s, 1.0),), MaxScorePicker())},
    )
    replicas = [rep("lost", running=40), rep("calm", running=40)]
    # 2 s of prefill sent to "lost" within the 2 s window: a duty cycle of 1, past 0.8.
    big = req(request_id="big", prompt_tokens=20_000, chain=[])
    s.score_with_terms(big, replicas)
    s.on_request_start(big, ReplicaId("lost"))
    decision = await engine.route(req(request_id="next"), replicas, "fleet-cost")
    # lost: 200 ms prefill + 60 contention + 100 decode interference, no protection charge;
    # calm: 200 + 60, plus 0.2 x 40 decodes x 200 ms when protection is on.
    assert decision.replica == expected


def test_queue_externality_follows_the_measured_arrival_rate() -> None:
    clock = _Clock(0.0)
    s = scorer(clock, **{**QUIET, "queue_weight": 1.0, "rate_window_s": 5.0})
    replicas = [rep("a", inflight_prefill_tokens=10_000), rep("b", inflight_prefill_tokens=10_000)]
    # 40 requests/s for 20 s: 20 per replica per second, each waiting 1 s queue + 0.2 s prefill.
    for i in range(800):
        clock.now = i / 40.0
        s.score_with_terms(req(request_id=f"q{i}"), replicas)
    _, terms = s.score_with_terms(req(request_id="last"), replicas)
    assert s.arrival_rate() == pytest.approx(40.0, rel=0.05)
    # Backlog is not drained here (nothing was started), so the wait is the counter's 1 s.
    assert terms[ReplicaId("a")]["externality_ms"] == pytest.approx(200.0 * 20 * 1.2, rel=0.05)


def test_arrival_rate_is_zero_before_any_request_and_decays_when_idle() -> None:
    rate = ArrivalRate(window_s=2.0)
    assert rate.rate(0.0) == 0.0
    for i in range(100):
        rate.tick(i * 0.1)  # 10/s for 10 s
    assert rate.rate(9.9) == pytest.approx(10.0, rel=0.05)
    assert rate.rate(29.9) < 0.1
    assert math.isfinite(rate.rate(1e9))


def test_calibration_still_learns_prefill_speed() -> None:
    s = scorer(**QUIET)
    replica = rep("a")
    for i in range(30):
        request = req(request_id=f"cal-{i}")
        s.score_with_terms(request, [replica])
        s.on_request_start(request, ReplicaId("a"))
        s.on_request_complete(request, ReplicaId("a"), 400.0, 0, True)  # half the speed
    speed = s.calibrated_speed(ReplicaId("a"))
    assert speed is not None and speed == pytest.approx(5_000.0, rel=0.02)


# --------------------------------------------------------------------------- hot prefix


async def test_hot_prefix_spreads_under_the_load_bound() -> None:
    """Stickiness must not defeat the bounded-load guard: a hot prefix is replicated."""
    p = builtin_profile("fleet-cost")
    for plugin in p.plugins:
        if isinstance(plugin, FleetCostScorer):
            plugin._clock = lambda: NOW  # replica figures in the scenario are read at NOW
    counts = await route_hot_prefix(p)
    assert sum(counts.values()) == REQUESTS
    assert counts.most_common(1)[0][1] <= 0.3 * REQUESTS
    assert len(counts) >= REPLICAS // 2


def test_builtin_profile_and_plugin_are_registered() -> None:
    p = builtin_profile("fleet-cost")
    assert p.name == "fleet-cost" and p.needs_prefix
    assert builtin_profile("fleet-cost").picker is not p.picker


async def test_requests_decoding_since_the_last_poll_break_a_tie() -> None:
    """Between two engine polls the gauges say both replicas idle; the gateway knows one of them
    has two of its requests decoding and the other one. Equal prefill, no queue anywhere: the
    decodes it can count decide (as in the real-vLLM prefix test, where first-round prefixes
    otherwise fell 6 to 2 on uniform tie-breaks and overflowed one engine's cache)."""
    replicas = [rep("two", inflight_requests=2), rep("one", inflight_requests=1)]
    assert [r.running_now for r in replicas] == [2, 1]
    for seed in range(20):  # whatever the tie-break seed
        decision = await RoutingEngine(None, {"fleet-cost": profile()}).route(
            req(seed=seed, prompt_tokens=780, chain=[]), replicas, "fleet-cost"
        )
        # 78 ms prefill each; decode contention 2 x 30 x 0.05 = 3 ms against 1.5 ms: 1.7%
        # apart with the 10 ms floor, past the 1% tie tolerance.
        assert decision.replica == "one"


def test_running_now_is_the_fresher_of_gauge_and_gateway_count() -> None:
    assert rep("a", running=5, inflight_requests=2).running_now == 5  # other clients' requests
    assert rep("b", running=0, inflight_requests=3, waiting=1).running_now == 2
    assert rep("c", running=0, inflight_requests=0, waiting=4).running_now == 0


# --------------------------------------------------------------------------- overflow

#: Two replicas so deep that a 2,000-token request misses a 2 s TTFT on either (queues of
#: 30,000 and 25,000 prefill tokens at 10,000 tokens/s).
DEEP = {"waiting": 0, "running": 4}


def deep_replicas(sink_load: int) -> list[ReplicaState]:
    return [
        rep("sink", inflight_requests=sink_load, inflight_prefill_tokens=30_000, **DEEP),
        rep("busy", inflight_requests=6, inflight_prefill_tokens=25_000, **DEEP),
    ]


def send_overflow(s: FleetCostScorer, replica: str, count: int) -> list[RoutingRequest]:
    """``count`` requests routed to ``replica`` as overflow (the scorer counts them there)."""
    sent = []
    for i in range(count):
        request = req(request_id=f"{replica}-overflow-{i}", overflow=True)
        s.on_request_start(request, ReplicaId(replica))
        sent.append(request)
    return sent


async def test_a_request_lost_everywhere_goes_where_no_savable_request_waits_it_out() -> None:
    """Both replicas are past the SLO; the sink holds only requests that were late already, so
    the lost request goes there even though it is far over the load bound (30 in flight
    against a mean of 18), and the other replica's six requests are not stalled."""
    s = scorer()
    send_overflow(s, "sink", 30)
    engine = RoutingEngine(
        None, {"fleet-cost": Profile("fleet-cost", (), ((s, 1.0),), MaxScorePicker())}
    )
    request = req(request_id="late")
    decision = await engine.route(request, deep_replicas(sink_load=30), "fleet-cost")
    assert decision.replica == "sink"
    assert request.overflow
    terms = decision.explanations[ReplicaId("busy")].terms
    assert terms["overflow"] == 1.0 and terms["savable_inflight"] == 6
    assert decision.explanations[ReplicaId("sink")].terms["savable_inflight"] == 0


async def test_without_overflow_the_load_bound_keeps_the_lost_request_off_the_sink() -> None:
    s = scorer(overflow_ttft_ms=None)
    send_overflow(s, "sink", 30)
    engine = RoutingEngine(
        None, {"fleet-cost": Profile("fleet-cost", (), ((s, 1.0),), MaxScorePicker())}
    )
    request = req(request_id="late")
    decision = await engine.route(request, deep_replicas(sink_load=30), "fleet-cost")
    assert decision.replica == "busy"
    assert not request.overflow


def test_a_request_that_can_make_its_slo_somewhere_is_routed_as_usual() -> None:
    s = scorer()
    replicas = [*deep_replicas(sink_load=30), rep("calm", inflight_requests=2)]
    request = req(request_id="on-time")
    scores, terms = s.score_with_terms(request, replicas)
    assert max(scores, key=scores.__getitem__) == "calm"
    assert not request.overflow
    assert all(terms[r.replica_id]["overflow"] == 0.0 for r in replicas)


def test_overflow_counts_follow_retries_and_completions() -> None:
    s = scorer()
    [first, second] = send_overflow(s, "sink", 2)
    replica = rep("sink", inflight_requests=2)
    assert s._savable(replica) == 0
    s.on_request_start(first, ReplicaId("busy"))  # a retry moves it to the fallback
    assert s._savable(replica) == 1
    s.on_request_complete(second, ReplicaId("sink"), 5_000.0, 0, True)
    s.on_request_complete(first, ReplicaId("busy"), 5_000.0, 0, True)
    assert s._savable(replica) == 2  # the two in flight there are not overflow any more
    assert (s._overflow.count(ReplicaId("sink")), s._overflow.count(ReplicaId("busy"))) == (0, 0)
    assert len(s._overflow) == 0


def test_the_overflow_bookkeeping_is_bounded() -> None:
    s = scorer(max_pending=4)
    send_overflow(s, "sink", 10)  # completions never reported
    assert len(s._overflow) == 4
    assert s._overflow.count(ReplicaId("sink")) == 4


def test_overflow_is_capped_at_a_share_of_recent_decisions() -> None:
    """Past the share, a late request is routed as usual: concentrating more than a few
    percent of requests on one replica would move the fleet's p95 TTFT into them."""
    clock = _Clock()
    s = scorer(clock, overflow_max_share=0.25, overflow_window_s=60.0)
    late = []
    for i in range(8):
        request = req(request_id=f"late-{i}")
        s.score_with_terms(request, deep_replicas(sink_load=30))
        late.append(request.overflow)
    # overflow share before each decision: 0, 1/1, 1/2, 1/3, 1/4, 1/5, 2/6, 2/7 (below 1/4?)
    assert late == [True, False, False, False, False, True, False, False]
    for i in range(20):  # on-time requests dilute the share
        clock.now += 1.0
        s.score_with_terms(req(request_id=f"on-time-{i}"), [rep("calm"), rep("calm-2")])
    request = req(request_id="late-again")
    s.score_with_terms(request, deep_replicas(sink_load=30))
    assert request.overflow


def test_decayed_share_counts_marked_decisions_over_its_window() -> None:
    """The share of the last decisions, weighted by recency (idle time alone changes nothing)."""
    share = DecayedShare(window_s=10.0)
    assert share.share(0.0) == 0.0
    for i in range(100):
        share.add(i * 0.1, marked=i % 4 == 0)
    assert share.share(10.0) == pytest.approx(0.25, abs=0.02)
    for i in range(100, 400):
        share.add(i * 0.1, marked=False)
    assert share.share(40.0) < 0.01


# --------------------------------------------------------------------------- short decodes


def start_short(
    s: FleetCostScorer, replica: str, max_tokens: int | None, rid: str
) -> RoutingRequest:
    """A request asking for ``max_tokens`` sent to ``replica`` (the scorer counts it there)."""
    request = req(request_id=rid, max_output_tokens=max_tokens)
    s.on_request_start(request, ReplicaId(replica))
    return request


@pytest.mark.parametrize(
    ("max_tokens", "prefill_ms", "stalled"),
    [
        # slack = 50 ms TPOT - 30 ms decode step = 20 ms per decode step
        pytest.param(
            3, 41.0, 1, id="3 tokens: 2 steps x 20 ms of slack; a 41 ms prefill is a miss"
        ),
        pytest.param(3, 40.0, 0, id="3 tokens: a 40 ms prefill fits the slack exactly"),
        pytest.param(64, 1_000.0, 0, id="64 tokens spread 1 s of prefill over 63 steps"),
        pytest.param(64, 1_300.0, 1, id="64 tokens: 1.3 s is past 63 x 20 ms"),
        pytest.param(65, 100_000.0, 0, id="more tokens than fragile_max_tokens: not tracked"),
        pytest.param(1, 100_000.0, 0, id="one token has no TPOT"),
        pytest.param(None, 100_000.0, 0, id="no max_tokens: unknown, never counted"),
    ],
)
def test_a_prefill_counts_the_short_decodes_it_would_push_past_their_tpot(
    max_tokens: int | None, prefill_ms: float, stalled: int
) -> None:
    s = scorer()
    start_short(s, "a", max_tokens, "short")
    assert s.fragile_stalled(rep("a"), prefill_ms) == stalled
    assert s.fragile_stalled(rep("b"), prefill_ms) == 0


def test_short_decodes_follow_retries_and_completions_and_the_count_is_bounded() -> None:
    s = scorer(max_pending=3)
    first = start_short(s, "a", 3, "first")
    start_short(s, "a", 3, "second")
    assert s.fragile_stalled(rep("a"), 1_000.0) == 2
    s.on_request_start(first, ReplicaId("b"))  # a retry moves it to the fallback
    assert s.fragile_stalled(rep("a"), 1_000.0) == 1
    assert s.fragile_stalled(rep("b"), 1_000.0) == 1
    s.on_request_complete(first, ReplicaId("b"), 100.0, 0, True)
    assert s.fragile_stalled(rep("b"), 1_000.0) == 0
    for i in range(10):  # completions never reported
        start_short(s, "c", 3, f"lost-{i}")
    assert len(s._fragile) == 3
    assert s.fragile_stalled(rep("c"), 1_000.0) + s.fragile_stalled(rep("a"), 1_000.0) == 3


def test_off_when_the_loss_is_zero() -> None:
    s = scorer(fragile_loss_ms=0.0)
    start_short(s, "a", 3, "short")
    assert s.fragile_stalled(rep("a"), 1_000.0) == 0
    _, terms = s.score_with_terms(req(request_id="long"), [rep("a"), rep("b")])
    assert terms[ReplicaId("a")]["fragile_ms"] == 0.0


def test_a_long_prefill_goes_where_no_short_decode_is_running() -> None:
    """2,000 uncached tokens at 10k tokens/s = 200 ms of prefill: a 3-token answer in flight on
    ``a`` would miss its TPOT, so ``a`` costs 1 s more; a 100-token prompt stalls no one."""
    s = scorer(**QUIET)
    start_short(s, "a", 3, "short")
    replicas = [rep("a"), rep("b")]
    scores, terms = s.score_with_terms(req(request_id="long"), replicas)
    assert terms[ReplicaId("a")]["fragile_ms"] == pytest.approx(1_000.0)
    assert terms[ReplicaId("b")]["fragile_ms"] == 0.0
    assert scores[ReplicaId("b")] == 1.0 and scores[ReplicaId("a")] < 0.25
    _, terms = s.score_with_terms(
        req(request_id="tiny", prompt_tokens=100, chain=[BlockHash(1)]), replicas
    )
    assert terms[ReplicaId("a")]["fragile_ms"] == 0.0


@pytest.mark.parametrize(
    ("waiting", "share"),
    [(0, 1.0), (5, 1.0 - 0.256), (10, 1.0 - 0.512), (20, 0.0), (40, 0.0)],
    ids=["no queue", "256 ms ahead", "512 ms ahead", "1.02 s ahead: none", "2 s ahead: none"],
)
def test_the_charge_falls_as_the_queue_ahead_grows(waiting: int, share: float) -> None:
    """The short decodes queued ahead of a long backlog run during the prefills in it (each
    waiting request counts 512 tokens, 51.2 ms at 10k tokens/s)."""
    s = scorer(**QUIET)
    start_short(s, "a", 3, "short")
    _, terms = s.score_with_terms(req(request_id="long"), [rep("a", waiting=waiting), rep("b")])
    assert terms[ReplicaId("a")]["fragile_ms"] == pytest.approx(1_000.0 * share)


# --------------------------------------------------------------------------- slack stickiness

#: Stickiness while the holder has slack, alone: no queue-depth weight, no other terms.
SLACK = {**QUIET, "duplicate_per_queued": 0.0, "slack_duplicate_weight": 1.0}


def _warmed(base: dict[str, Any] = SLACK, **params: Any) -> FleetCostScorer:
    """A scorer (``base`` parameters, then ``params``) whose usual TTFT has been learnt from 200
    decisions on a fleet where the best replica answered in 512 + 200 ms (ten requests queued
    everywhere)."""
    s = scorer(**{**base, **params})
    busy = [rep("a", waiting=10), rep("b", waiting=10)]
    for n in range(200):
        s.score_with_terms(req(request_id=f"warm-{n}", chain=[]), busy)
    return s


def _holder_or_cold(s: FleetCostScorer, holder_waiting: int, cold_cached_blocks: int) -> tuple:
    """Where a request goes between the replica holding 1,600 of its 2,000 tokens (with
    ``holder_waiting`` queued: 400 tokens to prefill behind them) and an idle one without them
    whose 200-block cache holds ``cold_cached_blocks``; and the terms."""
    replicas = [
        rep("holder", waiting=holder_waiting, kv_capacity_blocks=200, cached_blocks=200),
        rep("cold", kv_capacity_blocks=200, cached_blocks=cold_cached_blocks),
    ]
    scores, terms = s.score_with_terms(req(prefix_matches={ReplicaId("holder"): 100}), replicas)
    return max(scores, key=lambda rid: scores[rid]), terms


def test_a_holder_within_the_usual_ttft_keeps_a_prefix_a_full_cache_would_evict() -> None:
    # holder: 4 x 512 queued tokens (204.8 ms) + 40 ms; cold: 200 ms, and 160 ms of it is
    # prefill the holder would skip, written over someone's cached prefix.
    off, terms = _holder_or_cold(scorer(**{**SLACK, "slack_duplicate_weight": 0.0}), 4, 200)
    assert off == "cold" and terms[ReplicaId("cold")]["duplicate_weight"] == 0.0
    chosen, terms = _holder_or_cold(_warmed(), 4, 200)
    assert chosen == "holder"
    assert terms[ReplicaId("cold")]["duplicate_weight"] == 1.0
    assert terms[ReplicaId("cold")]["fleet_cost_ms"] == pytest.approx(200.0 + 160.0)


def test_stickiness_while_the_holder_has_slack_is_on_by_default() -> None:
    """Without the queue-depth weight, the default parameters alone keep the prefix on its
    holder (``slack_duplicate_weight`` 1 since session 27)."""
    chosen, terms = _holder_or_cold(_warmed({**QUIET, "duplicate_per_queued": 0.0}), 4, 200)
    assert chosen == "holder"
    assert terms[ReplicaId("cold")]["duplicate_weight"] == 1.0


def test_no_stickiness_where_the_duplicate_evicts_nothing() -> None:
    """A cache with room takes the duplicate for idle compute only: the request's TTFT wins."""
    chosen, terms = _holder_or_cold(_warmed(), 4, 0)
    assert chosen == "cold"
    assert terms[ReplicaId("cold")]["duplicate_weight"] == 0.0


def test_no_stickiness_when_the_holder_is_slower_than_usual() -> None:
    # 30 queued there: 1,536 + 40 ms, past the usual ~712 ms.
    chosen, _ = _holder_or_cold(_warmed(), 30, 200)
    assert chosen == "cold"


def test_stickiness_never_lowers_the_queue_depth_weight() -> None:
    s = _warmed(duplicate_per_queued=1.0, duplicate_free_depth=0.0)
    _, terms = _holder_or_cold(s, 4, 200)
    assert terms[ReplicaId("cold")]["duplicate_weight"] == 2.0  # mean depth 2 beats 1


@pytest.mark.parametrize("quantile", [0.5, 0.8, 0.9])
def test_the_running_quantile_settles_at_its_quantile(quantile: float) -> None:
    q = RunningQuantile(quantile)
    assert q.value is None
    for n in range(20_000):
        q.add(1.0 + (n * 37) % 100)  # 1..100, every value equally often
    assert q.value == pytest.approx(1.0 + 100 * quantile, rel=0.1)


def test_the_running_quantile_follows_a_shift() -> None:
    q = RunningQuantile(0.9)
    for n in range(2_000):
        q.add(100.0 + n % 10)
    for n in range(2_000):
        q.add(1000.0 + n % 10)
    assert q.value == pytest.approx(1009.0, rel=0.05)


# --------------------------------------------------------------------------- decodes by length


@pytest.mark.parametrize(
    ("params", "max_tokens", "weight"),
    [
        pytest.param({}, 400, 40.0 / 400, id="400 tokens: a stall of X ms adds X/400 to TPOT"),
        pytest.param({}, 20, 1.0, id="20 tokens: 2.0 capped at the whole prefill"),
        pytest.param({"decode_weight_max": 0.5}, 40, 0.5, id="the cap is a parameter"),
        pytest.param({}, None, 0.09, id="no max_tokens: decode_weight"),
        pytest.param({"decode_slo_ratio": None}, 20, 0.09, id="off: every decode decode_weight"),
        pytest.param({"decode_slo_ratio": 25.0}, 100, 0.25, id="a 1.25 s TTFT SLO over 50 ms"),
    ],
)
def test_a_decode_weighs_the_tpot_a_stall_adds_to_it(
    params: dict[str, Any], max_tokens: int | None, weight: float
) -> None:
    s = scorer(**params)
    assert s.decode_weight_of(req(max_output_tokens=max_tokens)) == pytest.approx(weight)


def test_a_long_prefill_goes_where_the_decodes_are_long() -> None:
    """Same number of running decodes, same queue: on "chat" each of 20 decodes asked for 1,000
    tokens and spreads the stall thin; on "short" each asked for 40 and takes it whole."""
    s = scorer(**{**QUIET, "decode_weight": 0.09, "decode_free_duty": None})
    for i in range(20):
        start_short(s, "chat", 1_000, f"chat-{i}")
        start_short(s, "short", 40, f"short-{i}")
    replicas = [rep("chat", running=20), rep("short", running=20)]
    scores, terms = s.score_with_terms(req(request_id="new"), replicas)
    # 200 ms of prefill x 20 decodes x 0.04 (40 / 1,000) and x 1.0 (40 / 40, at the cap)
    assert terms[ReplicaId("chat")]["externality_ms"] == pytest.approx(200.0 * 20 * 0.04)
    assert terms[ReplicaId("short")]["externality_ms"] == pytest.approx(200.0 * 20 * 1.0)
    assert max(scores, key=scores.__getitem__) == "chat"


def _sent_late(s: FleetCostScorer, replica: str, count: int) -> list[RoutingRequest]:
    """``count`` requests routed to ``replica`` where every replica was past the SLO (60 waiting:
    a 3 s queue) and the overflow share had run out (sent late, not as overflow)."""
    sent = []
    for i in range(count):
        request = req(request_id=f"{replica}-late-{i}")
        s.score_with_terms(request, [rep(replica, waiting=60), rep("other", waiting=60)])
        assert not request.overflow
        s.on_request_start(request, ReplicaId(replica))
        sent.append(request)
    return sent


@pytest.mark.parametrize(
    ("savable_only", "waiting", "charged"),
    [
        pytest.param(True, 0, 10 - 6, id="6 late running: 4 decodes can still make their SLOs"),
        pytest.param(True, 4, 10 - 2, id="4 of the late ones still queue: 2 of them run"),
        pytest.param(True, 8, 10, id="every late one still queues: all 10 running count"),
        pytest.param(False, 0, 10, id="off: every running decode counts"),
    ],
)
def test_decodes_that_are_late_already_are_not_charged(
    savable_only: bool, waiting: int, charged: int
) -> None:
    s = scorer(
        **{**QUIET, "decode_weight": 0.1, "decode_free_duty": None},
        decode_savable_only=savable_only,
        overflow_max_share=0.0,
    )
    late = _sent_late(s, "mixed", 6)
    replica = rep("mixed", running=10, waiting=waiting)
    assert s.savable_running(replica) == 10 - max(0, 6 - waiting)
    _, terms = s.score_with_terms(req(request_id="new", chain=[]), [replica, rep("idle")])
    assert terms[ReplicaId("mixed")]["externality_ms"] == pytest.approx(200.0 * 0.1 * charged)
    # A retry that is on time where it lands, and completions, clear the marks.
    s.on_request_start(late[0], ReplicaId("idle"))
    for request in late[1:]:
        s.on_request_complete(request, ReplicaId("mixed"), 5_000.0, 0, True)
    assert s._late.count(ReplicaId("mixed")) == 0
    assert s._late.count(ReplicaId("idle")) == 0
    assert len(s._decode_weights) == 1  # late[0], in flight on "idle"


# --------------------------------------------------------------------------- declared SLOs


def test_thresholds_follow_the_slo_a_request_declares_unless_set_in_the_policy() -> None:
    # A route with an 800 ms / 20 ms SLO got overflow only past 2.5 s and short-decode protection
    # at 50 ms: the thresholds were the 2,000 / 50 ms defaults whatever the route promised.
    s = scorer()
    undeclared = req(max_output_tokens=10)
    declared = req(max_output_tokens=10, ttft_slo_ms=800.0, tpot_slo_ms=20.0)
    assert s.overflow_limit_ms(undeclared) == 2500.0
    assert s.overflow_limit_ms(declared) == pytest.approx(1000.0)  # 1.25 x its SLO
    assert s.fragile_tpot_of(undeclared) == 50.0
    assert s.fragile_tpot_of(declared) == 20.0
    assert s.decode_weight_of(undeclared) == 1.0  # 40 / 10, capped at the whole stall
    assert s.decode_weight_of(req(max_output_tokens=400)) == pytest.approx(40.0 / 400)
    assert s.decode_weight_of(
        req(max_output_tokens=400, ttft_slo_ms=800.0, tpot_slo_ms=20.0)
    ) == pytest.approx(40.0 / 400)  # 800 / 20 is 40 too
    assert s.decode_weight_of(
        req(max_output_tokens=400, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    ) == pytest.approx(10.0 / 400)
    # Set in the policy, a threshold is the operator's, whatever the request declares.
    pinned = scorer(overflow_ttft_ms=3000.0, fragile_tpot_ms=60.0, decode_slo_ratio=30.0)
    assert pinned.overflow_limit_ms(declared) == 3000.0
    assert pinned.fragile_tpot_of(declared) == 60.0
    assert pinned.decode_weight_of(
        req(max_output_tokens=400, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    ) == pytest.approx(30.0 / 400)
    assert scorer(overflow_ttft_ms=None).overflow_limit_ms(declared) is None


def test_a_short_decode_is_protected_at_the_tpot_its_request_declared() -> None:
    # A 3-token answer shares a prefill's stall over its 2 decode steps: with 30 ms decode steps
    # it has 2 x (50 - 30) = 40 ms of slack at the default TPOT, 2 x (80 - 30) = 100 ms at 80.
    s = scorer()
    strict = req(request_id="strict", max_output_tokens=3)
    loose = req(request_id="loose", max_output_tokens=3, ttft_slo_ms=2000.0, tpot_slo_ms=80.0)
    for request in (strict, loose):
        s.on_request_start(request, ReplicaId(request.request_id))
    assert s.fragile_stalled(rep("strict"), 60.0) == 1
    assert s.fragile_stalled(rep("loose"), 60.0) == 0
    assert s.fragile_stalled(rep("loose"), 120.0) == 1


@pytest.mark.parametrize("figures_age_s", [0.0, 60.0])
async def test_old_figures_alone_make_no_request_late_or_overflow(figures_age_s: float) -> None:
    """The routing review of session 46: with every replica's /metrics unread for a minute, the
    staleness penalty (distrust, not a predicted queue) put every request of an idle fleet
    past the overflow limit: 15 of 200 went as overflow, all of them counted late."""
    profile = builtin_profile("fleet-cost")
    cost = profile.scorers[0][0]
    assert isinstance(cost, FleetCostScorer)
    cost._clock = lambda: NOW
    elapsed = [0.0]
    cost._elapsed_clock = lambda: elapsed[0]
    engine = RoutingEngine(None, {profile.name: profile})
    read_at = NOW - figures_age_s
    fleet = [
        ReplicaState(ReplicaId(f"r{i}"), f"http://r{i}", models=frozenset({"m"}),
                     metrics_read_at=read_at)
        for i in range(4)
    ]
    overflow = 0
    for i in range(200):
        elapsed[0] += 0.05
        request = RoutingRequest(
            request_id=f"q{i}", model="m", adapter=None, tenant="t", route="d",
            prompt_tokens=1000, chain=[BlockHash(i * 1000 + j) for j in range(60)], seed=i,
        )
        decision = await engine.route(request, fleet, profile.name)
        engine.observe_start(request, decision.replica)
        overflow += request.overflow
    assert overflow == 0
    assert sum(cost._late.count(r.replica_id) for r in fleet) == 0
