"""Gateway building blocks without sockets: breaker, cost attribution, SSE relay, rate limits,
prediction outcomes, request validation, policy view."""

from __future__ import annotations

import json
import math

import pytest

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.cost import ReplicaTimeMeter, RouteWindow
from gateway.errors import GatewayError
from gateway.policy_view import AdapterEntry, GatewayPolicy, Route, Tenant, sha256_hex
from gateway.proxy import SseRelay, body_usage
from gateway.ratelimit import RateLimiter
from gateway.replicas import parse_vllm_metrics
from gateway.request.account import cached_in_routing_units, cached_tokens_of, prediction_outcome
from gateway.request_body import validate
from routing.types import ReplicaId


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_health_poll_clears_refused_and_dropped_connections_only() -> None:
    clock = Clock()
    restarted = CircuitBreaker(failure_threshold=2, cooldown_s=10, clock=clock)
    restarted.failure(health_clears=True)  # refused or dropped: a killed engine
    restarted.failure(health_clears=True)
    assert restarted.state is BreakerState.OPEN
    restarted.health_ok()  # it answers again: back at once, no cooldown
    assert restarted.state is BreakerState.CLOSED

    wedged = CircuitBreaker(failure_threshold=2, cooldown_s=10, clock=clock)
    wedged.failure()  # a timeout or a 5xx: /health answering says nothing about requests
    wedged.health_ok()
    wedged.failure(health_clears=True)
    assert wedged.state is BreakerState.OPEN  # the poll between did not reset the count
    wedged.health_ok()
    assert wedged.state is BreakerState.OPEN
    clock.now += 10
    wedged.begin()
    wedged.success()  # only a request that succeeds closes it
    assert wedged.state is BreakerState.CLOSED
    wedged.failure(health_clears=True)
    wedged.health_ok()
    assert wedged.state is BreakerState.CLOSED and wedged.allows()


def test_a_refused_connection_opens_the_circuit_at_once_until_a_health_poll_answers() -> None:
    clock = Clock()
    killed = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=clock)
    killed.failure(health_clears=True, refused=True)  # nothing listens: the next would fail too
    assert killed.state is BreakerState.OPEN
    killed.health_ok()  # restarted: back at the first poll it answers
    assert killed.state is BreakerState.CLOSED

    wedged = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=clock)
    wedged.failure()  # timed out first: a poll that answers says nothing about requests
    wedged.failure(health_clears=True, refused=True)
    wedged.health_ok()
    assert wedged.state is BreakerState.OPEN


def test_breaker_opens_after_threshold_and_probes_once_after_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=10, clock=clock)
    breaker.failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now = 10
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.begin()
    assert not breaker.allows()  # one probe at a time
    breaker.failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 20
    breaker.begin()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED


def test_replica_time_is_shared_between_concurrent_requests() -> None:
    clock = Clock()
    meter = ReplicaTimeMeter(clock)
    r = ReplicaId("r0")
    meter.start(r, 1)
    clock.now = 2.0  # alone for 2 s
    meter.start(r, 2)
    clock.now = 6.0  # shared for 4 s: 2 s each
    assert meter.finish(r, 1) == pytest.approx(4.0)
    clock.now = 7.0  # alone again for 1 s
    assert meter.finish(r, 2) == pytest.approx(3.0)


def test_replica_time_is_shared_with_other_gateways_requests_there() -> None:
    # Counted alone, each of two gateways charged its request the whole stretch: the fleet's
    # replica-seconds summed to twice the replica's busy time.
    clock = Clock()
    others = {ReplicaId("r0"): 1}  # another gateway's request runs there the whole time
    meter = ReplicaTimeMeter(clock, others=lambda replica: others.get(replica, 0))
    r = ReplicaId("r0")
    meter.start(r, 1)
    clock.now = 4.0
    others[r] = 0  # theirs has ended: the next sync says so, and the meter reads it again
    meter.refresh()
    clock.now = 6.0
    assert meter.finish(r, 1) == pytest.approx(4.0 / 2 + 2.0)


def test_cost_splits_pool_bill_by_busy_share() -> None:
    clock = Clock()
    window = RouteWindow(window_s=3600, clock=clock)
    clock.now = 3600.0  # a full hour of window
    window.add(
        "chat",
        "a",
        replica_seconds=300,
        prompt_tokens=900_000,
        cached_tokens=0,
        completion_tokens=100_000,
    )
    window.add(
        "batch",
        "a",
        replica_seconds=100,
        prompt_tokens=500_000,
        cached_tokens=0,
        completion_tokens=0,
    )
    cost = window.cost_per_1m({"a": 4.0}, {"a": 2})
    # Pool bill: $4/h x 2 replicas x 1 h = $8, split 3:1 by busy seconds.
    assert cost["chat"] == pytest.approx(6.0 / 1.0)
    assert cost["batch"] == pytest.approx(2.0 / 0.5)


def test_hit_rate_over_window_forgets_old_requests() -> None:
    clock = Clock()
    window = RouteWindow(window_s=60, clock=clock)
    window.add("r", "a", 1, prompt_tokens=100, cached_tokens=0, completion_tokens=1)
    clock.now = 61
    window.add("r", "a", 1, prompt_tokens=100, cached_tokens=80, completion_tokens=1)
    assert window.hit_rates() == {"r": 0.8}


def _sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_sse_relay_emits_complete_events_and_hides_requested_usage_chunk() -> None:
    relay = SseRelay(hide_usage_chunk=True)
    first = _sse({"choices": [{"delta": {"content": "a"}}]})
    usage = _sse({"choices": [], "usage": {"prompt_tokens": 5}})
    assert relay.feed(first[:7]) == []
    assert relay.feed(first[7:] + usage + b"data: [DONE]\n\n") == [first, b"data: [DONE]\n\n"]
    assert relay.usage == {"prompt_tokens": 5}


def test_sse_relay_keeps_usage_chunk_the_client_asked_for() -> None:
    relay = SseRelay(hide_usage_chunk=False)
    usage = _sse({"choices": [], "usage": {"prompt_tokens": 5}})
    assert relay.feed(usage) == [usage]


def test_sse_relay_passes_odd_events_through_and_ignores_what_is_not_usage() -> None:
    relay = SseRelay(hide_usage_chunk=True)
    events = [
        b"data: not json but mentions \"usage\"\n\n",
        _sse({"choices": [{"delta": {"content": 'say "usage"'}}]}),
        _sse({"choices": [], "usage": None}),
        _sse({"choices": [], "usage": 5}),
        b": keep-alive comment\n\n",
    ]
    assert relay.feed(b"".join(events)) == events
    assert relay.usage is None


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        (b'{"choices": [], "usage": {"prompt_tokens": 3}}', {"prompt_tokens": 3}),
        (b'{"choices": []}', None),
        (b'{"usage": null}', None),
        (b'{"usage": [1]}', None),
        (b"[1, 2]", None),
        (b"<html>bad gateway</html>", None),
        # vLLM's /v2/embed (Cohere's shape): the input count is in meta.billed_units.
        (
            b'{"meta": {"billed_units": {"input_tokens": 12, "image_tokens": 5}}}',
            {"prompt_tokens": 17, "completion_tokens": 0, "total_tokens": 17},
        ),
        (b'{"meta": {"billed_units": {"input_tokens": null}}}', None),
        (b'{"meta": {"billed_units": [3]}}', None),
        (b'{"meta": {"api_version": {"version": "2"}}}', None),
        (b'{"meta": 7}', None),
    ],
)
def test_body_usage_reads_usage_only_and_never_raises(body: bytes, usage: object) -> None:
    assert body_usage(body) == usage


def test_rate_limiter_refills_at_the_configured_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    assert limiter.acquire("t", 2.0, burst=2) is None
    assert limiter.acquire("t", 2.0, burst=2) is None
    assert limiter.acquire("t", 2.0, burst=2) == pytest.approx(0.5)
    clock.now = 0.5
    assert limiter.acquire("t", 2.0, burst=2) is None
    assert limiter.acquire("other", None, burst=1) is None


@pytest.mark.parametrize(
    ("predicted", "actual", "outcome"),
    [(160, 160, "exact"), (160, 150, "exact"), (160, 144, "over"), (0, 32, "under")],
)
def test_prediction_outcome_is_block_granular(predicted: int, actual: int, outcome: str) -> None:
    assert prediction_outcome(predicted, actual, block_size=16) == outcome


@pytest.mark.parametrize(
    ("token_ids", "cached", "engine_prompt", "expected"),
    [
        (None, 1400, 1500, 2520),  # text mode: the engine's cached share of routing's estimate
        (None, 0, 1500, 0),
        (None, 1500, 1000, 2700),  # never more than the whole prompt
        (None, 1400, None, 1400),  # no engine count to scale by: as reported
        (None, None, 1500, None),
        ((1, 2, 3), 1400, 1500, 1400),  # real tokens: one unit already
    ],
)
def test_cached_tokens_reach_calibration_in_routings_units(
    token_ids: tuple[int, ...] | None, cached: int | None, engine_prompt: int | None,
    expected: int | None,
) -> None:
    """Calibration learns prefill speed from routing's prompt count less the engine's cached
    tokens: in text mode (a 2,700-token estimate of a 1,500-token prompt) they must be one unit,
    or a 93% hit reads as 1,300 uncached tokens instead of 180 (the heterogeneous-fleet
    review: learned speeds 3-5 times too fast)."""
    from types import SimpleNamespace

    routed = SimpleNamespace(
        routing_request=SimpleNamespace(prompt_tokens=2700),
        prompt=SimpleNamespace(token_ids=token_ids),
    )
    assert cached_in_routing_units(routed, cached, engine_prompt) == expected  # type: ignore[arg-type]


def test_cached_tokens_absent_when_engine_does_not_report() -> None:
    assert cached_tokens_of({"prompt_tokens": 3}) is None
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": 7}}) == 7


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ({"messages": [{"role": "user"}]}, "chat", "model"),
        ({"model": "m", "messages": "hi"}, "chat", "messages"),
        ({"model": "m", "prompt": [1, "a"]}, "completion", "prompt"),
        ({"model": "m", "prompt": "x", "stream": 1}, "completion", "stream"),
    ],
)
def test_validation_names_the_bad_field(body: dict[str, object], kind: str, param: str) -> None:
    with pytest.raises(GatewayError) as err:
        validate(body, kind)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("prompt", ["x", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_validation_accepts_every_vllm_prompt_shape(prompt: object) -> None:
    validate({"model": "m", "prompt": prompt}, "completion")


def test_policy_view_hides_other_tenants_adapters() -> None:
    acme, globex = Tenant("acme"), Tenant("globex", allowed_adapters=frozenset({"acme-lora"}))
    policy = GatewayPolicy(
        tenants_by_key_sha256={sha256_hex("k1"): acme, sha256_hex("k2"): globex},
        adapters={"acme-lora": AdapterEntry("acme-lora", "base", frozenset({"acme"}), False)},
    )
    assert policy.tenant_for_key("k1") == acme
    assert policy.tenant_for_key("nope") is None and policy.tenant_for_key(None) is None
    assert policy.resolve_model(acme, "acme-lora") == ("base", "acme-lora")
    assert policy.resolve_model(globex, "acme-lora") == ("base", "acme-lora")
    assert policy.resolve_model(Tenant("other"), "acme-lora") is None


def test_open_policy_takes_any_key_as_default_tenant() -> None:
    policy = GatewayPolicy.default()
    assert policy.tenant_for_key(None) == policy.tenant_for_key("anything") == Tenant("default")
    assert policy.route_for("/v1/completions", "m", "default", {}) == Route("default")


def test_vllm_gauges_are_summed_across_label_sets() -> None:
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 4
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:prefix_cache_hits_total{model_name="m"} 99
"""
    assert parse_vllm_metrics(text) == {"running": 3.0, "waiting": 4.0, "kv_usage": 0.25}
    # The ITL histogram's running sum and count (not its buckets) are read too.
    itl = """vllm:inter_token_latency_seconds_bucket{le="0.05",model_name="m"} 10
vllm:inter_token_latency_seconds_sum{model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{model_name="m"} 30
"""
    assert parse_vllm_metrics(itl) == {"itl_sum_s": 1.5, "itl_count": 30.0}
    # A scrape glitch (NaN, Inf, a negative gauge) is not a figure: the field reads NaN, and the
    # poll keeps the replica's last reading (int(NaN) used to raise and freeze its state).
    glitch = """vllm:num_requests_running{model_name="m"} NaN
vllm:num_requests_waiting{engine="0"} 3
vllm:num_requests_waiting{engine="1"} +Inf
vllm:kv_cache_usage_perc{model_name="m"} -0.5
"""
    parsed = parse_vllm_metrics(glitch)
    assert set(parsed) == {"running", "waiting", "kv_usage"}
    assert all(math.isnan(v) for v in parsed.values())


def test_a_cleared_labelled_gauge_exports_what_is_set_after() -> None:
    # Cleared on the metric alone, the cache handed back a detached child: the pool bill and the
    # policy digest vanished from /metrics after their second refresh.
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    for _ in range(3):
        metrics.pool_bill.clear()
        metrics.pool_bill.labels("default").set(6.0)
        metrics.set_policy("abc")
    text = generate_latest(metrics.registry).decode()
    assert 'fleetgate_pool_bill_usd_per_hour{pool="default"} 6.0' in text
    assert 'fleetgate_policy_info{digest="abc"} 1.0' in text


@pytest.mark.parametrize(
    ("message", "disabled"),
    [
        ("LoRA is disabled on this engine (max_loras = 0)", True),  # the simulated engine
        ("Loading lora x failed: LoRA is not enabled. Use --enable-lora to enable LoRA.", True),
        # Adapter-specific refusals, and paths, are not the engine's (the diff review).
        ("Loading lora x failed: Adapter bias cannot be used without --enable-lora-bias.", False),
        ("Loading lora sql-lora failed: No adapter found for /models/disabled/sql-lora", False),
        ("HTTP 500: EngineCore encountered an issue.", False),
    ],
)
def test_only_an_engine_without_lora_is_marked_as_having_no_slots(
    message: str, disabled: bool
) -> None:
    from gateway.adapters import names_lora_disabled

    assert names_lora_disabled(message) is disabled


def test_a_pool_declaring_no_lora_slots_gives_its_replicas_none() -> None:
    # Declared `max_loras: 0` reached only the adapter loader's capacity, not routing: a burst
    # still tried each such replica (the heterogeneous-fleet re-check).
    from gateway.policy_view import PoolSpeeds, ReplicaSpec
    from gateway.replicas import ReplicaRegistry
    from routing.types import ReplicaId

    registry = ReplicaRegistry()
    registry.set_static([
        ReplicaSpec("p/plain", "http://plain", "p", speeds=PoolSpeeds(lora_off=True)),
        ReplicaSpec("q/lora", "http://lora", "q"),
    ])
    plain, lora = registry.get(ReplicaId("p/plain")), registry.get(ReplicaId("q/lora"))
    assert plain is not None and plain.max_loras == 0
    assert lora is not None and lora.max_loras is None  # unknown until its engine says


def test_a_pre_warm_refused_for_lack_of_lora_teaches_what_a_request_would() -> None:
    from adapters_registry.prewarm import PlanStep, ReconcileReport
    from gateway.adapters import learn_lora_disabled
    from gateway.policy_view import ReplicaSpec
    from gateway.replicas import ReplicaRegistry

    registry = ReplicaRegistry()
    registry.set_static([ReplicaSpec("p/a", "http://a", "p"), ReplicaSpec("p/b", "http://b", "p")])
    refused = "loading adapter 'x' failed: HTTP 500: LoRA is disabled on this engine"
    report = ReconcileReport(failed=[
        (PlanStep(ReplicaId("p/a"), "x"), refused),
        (PlanStep(ReplicaId("p/b"), "y"), "HTTP 400: No adapter found for /models/y"),
    ])
    learn_lora_disabled(registry, report)
    states = [registry.get(ReplicaId(r)) for r in ("p/a", "p/b")]
    assert [s.max_loras for s in states if s is not None] == [0, None]


def test_a_reload_brings_a_pools_speeds_and_declared_lora_slots_to_its_replicas() -> None:
    # They kept the first load's until a restart (the re-check review).
    from gateway.policy_view import PoolSpeeds, ReplicaSpec
    from gateway.replicas import ReplicaRegistry

    def load(speeds: PoolSpeeds) -> None:
        registry.set_static([ReplicaSpec("p/a", "http://a", "p", speeds=speeds)])

    registry = ReplicaRegistry()
    load(PoolSpeeds(5_000.0, 20.0))
    load(PoolSpeeds(20_000.0, 7.0, lora_off=True))
    state = registry.get(ReplicaId("p/a"))
    assert state is not None
    assert (state.prefill_tokens_per_s, state.decode_step_ms, state.max_loras) == (20_000.0, 7.0, 0)
    load(PoolSpeeds(20_000.0, 7.0))  # the declaration taken away: unknown again
    state = registry.get(ReplicaId("p/a"))
    assert state is not None and state.max_loras is None
    registry.lora_disabled(ReplicaId("p/a"))  # its engine refused a load for want of LoRA
    load(PoolSpeeds(20_000.0, 7.0))
    state = registry.get(ReplicaId("p/a"))
    assert state is not None and state.max_loras == 0
