"""The agent's small parts: hash map, sequence tracker, epoch clock, config, scrape parsing,
fleet store (memory), and reading the operator's vLLM arguments."""

from __future__ import annotations

import json

import pytest

from fleetgate.commands.replica import inspect_vllm_args
from replica.agent import AgentConfig, EpochClock
from replica.agent.hash_map import EngineHashMap
from replica.agent.scrape import parse_metrics, parse_models
from replica.agent.sequence import SequenceTracker, SeqVerdict
from replica.fleet_store import MemoryFleetStore, build_fleet_store, state_from_json, state_to_json
from routing.state import ReplicaState
from routing.types import BlockHash, Epoch, ReplicaId

# --------------------------------------------------------------------------- hash map


def test_hash_map_evicts_least_recently_used_and_counts_live_losses() -> None:
    m = EngineHashMap(capacity=2)
    m.store(1, BlockHash(10))
    m.store(2, BlockHash(20))
    assert m.resolve(1) == 10  # touch 1: now 2 is the oldest
    m.store(3, BlockHash(30))
    assert m.resolve(2) is None
    assert m.evicted_live == 1
    assert m.evict(3) == 30
    assert m.evict(3) is None  # already evicted
    assert m.resolve(3) == 30  # still resolvable as a parent
    assert list(m.live_blocks()) == [10]
    m.mark_all_evicted()
    assert list(m.live_blocks()) == []
    m.clear()
    assert len(m) == 0


def test_hash_map_counts_the_blocks_the_engine_holds() -> None:
    """``live_count`` (the replica's ``cached_blocks``) equals the live entries after every
    kind of change."""
    m = EngineHashMap(capacity=3)
    steps = [
        lambda: m.store(1, BlockHash(10)),
        lambda: m.store(2, BlockHash(20)),
        lambda: m.store(2, BlockHash(20)),  # stored again: still one block
        lambda: m.evict(1),
        lambda: m.evict(1),  # removed twice: counted once
        lambda: m.store(1, BlockHash(10)),  # stored again after eviction
        lambda: m.store(3, BlockHash(30)),
        lambda: m.store(4, BlockHash(40)),  # capacity: the oldest live entry goes
        lambda: m.mark_all_evicted(),
        lambda: m.store(5, BlockHash(50)),
        lambda: m.clear(),
    ]
    counts = []
    for step in steps:
        step()
        assert m.live_count == len(list(m.live_blocks()))
        counts.append(m.live_count)
    assert counts == [1, 2, 2, 1, 1, 2, 3, 3, 0, 1, 0]


def test_hash_map_rejects_zero_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EngineHashMap(0)


# --------------------------------------------------------------------------- sequences


@pytest.mark.parametrize(
    ("accepted", "seq", "verdict"),
    [
        (None, 0, SeqVerdict.IN_ORDER),
        (None, 57, SeqVerdict.IN_ORDER),  # joining a running stream
        (4, 5, SeqVerdict.IN_ORDER),
        (4, 7, SeqVerdict.GAP),
        (4, 0, SeqVerdict.RESTART),
        (4, 3, SeqVerdict.RESTART),
    ],
)
def test_sequence_tracker(accepted: int | None, seq: int, verdict: SeqVerdict) -> None:
    tracker = SequenceTracker()
    if accepted is not None:
        tracker.accept(accepted)
    assert tracker.classify(seq) is verdict


def test_sequence_tracker_reset_and_bad_input() -> None:
    tracker = SequenceTracker()
    tracker.accept(9)
    tracker.reset()
    assert tracker.classify(0) is SeqVerdict.IN_ORDER
    with pytest.raises(ValueError, match="non-negative"):
        tracker.classify(-1)


def test_epoch_clock_is_strictly_increasing_even_if_time_stands_still() -> None:
    clock = EpochClock(clock=lambda: 1000.0)
    assert [clock(), clock(), clock()] == [1_000_000, 1_000_001, 1_000_002]


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_id": ""}, "replica_id"),
        ({"engine_url": "127.0.0.1:8000"}, "engine_url"),
        ({"scrape_interval_s": 0}, "scrape_interval_s"),
        ({"heartbeat_ttl_s": 0.2}, "heartbeat_ttl_s .* must exceed scrape_interval_s"),
        ({"replay_endpoint": "tcp://127.0.0.1:1"}, "kv_events_endpoint is not"),
        ({"map_capacity": 0}, "map_capacity"),
    ],
)
def test_agent_config_errors_name_the_setting(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"replica_id": "r0", "engine_url": "http://127.0.0.1:8000"}
    with pytest.raises(ValueError, match=message):
        AgentConfig(**{**base, **kwargs})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- scrape parsing

#: Lines captured from a real vLLM 0.32.0 CPU engine's /metrics (tiny model, LoRA enabled),
#: with cache_config_info's labels trimmed to the ones fleetgate reads plus a few neighbours.
REAL_VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.125
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7959530996168783e+09
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7959531020215285e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="tiny-lora-0",waiting_lora_adapters="tiny-lora-0,tiny-lora-1"} 1.7959531019661906e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_cpu_blocks="None",num_gpu_blocks="32768",prefix_caching_hash_algo="sha256"} 1.0
"""  # noqa: E501


def test_parse_real_vllm_metrics() -> None:
    figures = parse_metrics(REAL_VLLM_METRICS)
    assert figures == {
        "kv_usage": 0.125,
        "running": 2,
        "waiting": 1,
        "preemptions_total": 3,
        "max_loras": 2,
        # the latest lora_requests_info sample (largest value) is the current one
        "running_adapters": frozenset(),
        "waiting_adapters": frozenset(),
        "block_size": 32,
        "num_gpu_blocks": 32768,
        "steps_total": None,  # not in these lines: the stall check stays off
    }


def test_parse_the_engine_step_count_from_the_iteration_tokens_histogram() -> None:
    """Summed over engine cores (data-parallel ranks); the stall check reads it."""
    text = REAL_VLLM_METRICS + "".join(
        "# TYPE vllm:iteration_tokens_total histogram\n" * (engine == 0)
        + f'vllm:iteration_tokens_total_bucket{{engine="{engine}",le="+Inf",model_name="tiny"}} '
        f"{count}\n"
        f'vllm:iteration_tokens_total_count{{engine="{engine}",model_name="tiny"}} {count}\n'
        f'vllm:iteration_tokens_total_sum{{engine="{engine}",model_name="tiny"}} 999.0\n'
        for engine, count in ((0, "12.0"), (1, "30.0"))
    )
    assert parse_metrics(text)["steps_total"] == 42


def test_parse_lora_info_takes_the_latest_sample() -> None:
    text = REAL_VLLM_METRICS.replace("1.7959531019661906e+09", "1.8e+09")
    figures = parse_metrics(text)
    assert figures["running_adapters"] == {"tiny-lora-0"}
    assert figures["waiting_adapters"] == {"tiny-lora-0", "tiny-lora-1"}


def test_parse_empty_metrics_gives_unknowns() -> None:
    figures = parse_metrics("")
    assert figures["block_size"] is None and figures["max_loras"] is None
    assert figures["running"] == 0


def test_parse_models_splits_bases_and_adapters() -> None:
    body = {"data": [
        {"id": "tiny", "parent": None},
        {"id": "tiny-lora-0", "parent": "tiny"},
    ]}
    assert parse_models(body) == (("tiny",), frozenset({"tiny-lora-0"}))


# --------------------------------------------------------------------------- fleet store


def _state(rid: str, **kw: object) -> ReplicaState:
    return ReplicaState(replica_id=ReplicaId(rid), url=f"http://{rid}:8000", **kw)  # type: ignore[arg-type]


def test_state_json_round_trip() -> None:
    state = _state(
        "a", models=frozenset({"m"}), epoch=Epoch(7), loaded_adapters=frozenset({"x", "y"}),
        kv_capacity_blocks=10, kernel_plugins={"k": "1"}, metrics_read_at=5.0,
    )
    raw = state_to_json(state)
    assert json.loads(raw)["loaded_adapters"] == ["x", "y"]
    assert state_from_json(raw) == state


def test_state_from_json_rejects_garbage_and_ignores_unknown_keys() -> None:
    with pytest.raises(ValueError, match="not a replica state"):
        state_from_json('{"foo": 1}')
    parsed = state_from_json('{"replica_id": "a", "url": "u", "from_the_future": 1}')
    assert parsed.replica_id == "a"


async def test_memory_fleet_store_expires_without_heartbeat() -> None:
    now = [0.0]
    store = MemoryFleetStore(clock=lambda: now[0])
    await store.register(_state("b"), ttl_s=3)
    await store.publish(_state("a"), ttl_s=1)
    assert [s.replica_id for s in await store.list_replicas()] == ["a", "b"]
    now[0] = 2.0
    assert [s.replica_id for s in await store.list_replicas()] == ["b"]
    await store.remove(ReplicaId("b"))
    assert await store.list_replicas() == []
    # A removal is remembered (gateways drop it at once); an expiry is not.
    assert await store.departed() == {ReplicaId("b")}
    with pytest.raises(ValueError, match="ttl_s"):
        await store.publish(_state("a"), ttl_s=0)


def test_build_fleet_store_rejects_unknown_urls() -> None:
    assert isinstance(build_fleet_store(None), MemoryFleetStore)
    with pytest.raises(ValueError, match="redis://"):
        build_fleet_store("http://redis:6379")


# --------------------------------------------------------------------------- replica run args


def test_inspect_vllm_args_adds_kv_events_and_finds_the_engine() -> None:
    view = inspect_vllm_args(["--model", "m", "--host", "0.0.0.0", "--port=9001"])
    assert view.url == "http://127.0.0.1:9001"
    added = json.loads(view.args[view.args.index("--kv-events-config") + 1])
    assert added["endpoint"].startswith("tcp://*:")
    assert view.kv_events_endpoint == added["endpoint"].replace("*", "127.0.0.1")
    # With a replay socket, so the agent's catch-up can learn what a running engine holds.
    assert added["replay_endpoint"].startswith("tcp://*:")
    assert added["replay_endpoint"] != added["endpoint"]
    assert view.replay_endpoint == added["replay_endpoint"].replace("*", "127.0.0.1")


def test_inspect_vllm_args_respects_the_operators_kv_config() -> None:
    config = json.dumps({
        "enable_kv_cache_events": True, "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:6001", "topic": "t",
    })
    view = inspect_vllm_args(["--kv-events-config", config, "--max-cpu-loras", "8"])
    assert view.args.count("--kv-events-config") == 1
    assert (view.kv_events_endpoint, view.replay_endpoint, view.topic) == (
        "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001", "t",
    )
    assert view.max_cpu_loras == 8
    assert view.url == "http://127.0.0.1:8000"


def test_inspect_vllm_args_refuses_bad_kv_config() -> None:
    with pytest.raises(SystemExit, match="not JSON"):
        inspect_vllm_args(["--kv-events-config", "{nope"])


def test_inspect_vllm_args_brackets_an_ipv6_host() -> None:
    """``--host ::1`` made ``http://::1:9001``, which no URL parser reads (diff review)."""
    view = inspect_vllm_args(["--host", "::1", "--port", "9001"])
    assert view.url == "http://[::1]:9001"
    # Its events are not at that address: vLLM binds tcp://*:PORT on IPv4 only, on this host
    # (diff review: tcp://[::1]:PORT received nothing).
    assert view.kv_events_endpoint is not None
    assert view.kv_events_endpoint.startswith("tcp://127.0.0.1:")
    assert view.replay_endpoint is not None and view.replay_endpoint.startswith("tcp://127.0.0.1:")


async def test_the_agent_warns_of_a_down_engine_once_the_miss_rule_calls_it_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One missed probe under load is no outage (the replica stays up) and logged no warning
    worth the name; two in a row are. An engine the supervisor is stopping on purpose is no
    outage at all (live review: a warning after every clean drain)."""
    from replica.agent import ReplicaAgent
    from routing.index import MemoryBlockIndex

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    agent = ReplicaAgent(
        AgentConfig(replica_id="pool/r0", engine_url="http://127.0.0.1:9", listen_port=None),
        index=MemoryBlockIndex(), fleet=MemoryFleetStore(),
    )
    try:
        await agent._note_health(True)
        await agent._note_health(False)
        assert agent.engine_up and warnings() == []
        await agent._note_health(False)
        assert not agent.engine_up
        assert len(warnings()) == 1 and "missed 2 health checks in a row" in warnings()[0]

        caplog.clear()
        await agent._note_health(True)
        await agent.leave()
        assert agent.state().draining and not agent.state().healthy
        for _ in range(3):
            await agent._note_health(False)
        assert not agent.engine_up and warnings() == []
        assert not agent.state().draining  # its engine is gone: nothing left to drain
    finally:
        await agent.scraper.close()


def test_the_prestop_drain_counts_what_the_engine_holds() -> None:
    from replica.drain_wait import requests_in_engine

    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        "vllm:num_requests_waiting_by_reason 9.0\n"
    )
    assert requests_in_engine(text) == 6
    assert requests_in_engine("vllm:num_requests_running 0.0\n") == 0
    assert requests_in_engine("up 1\n") is None  # no gauges: unknown (it waits to its timeout)


async def test_the_agent_warns_once_per_fleet_store_outage_and_says_when_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While it cannot register, no gateway discovering replicas through the store sees this
    one: worth a warning, once (TLS review: every failure was DEBUG, so a replica that never
    registered left nothing in its log), and a line when registration works again."""
    from replica.agent import ReplicaAgent
    from replica.fleet_store import FleetStoreUnavailable
    from routing.index import MemoryBlockIndex

    class FlakyStore(MemoryFleetStore):
        down = True

        async def register(self, state: ReplicaState, ttl_s: float) -> None:
            if self.down:
                raise FleetStoreUnavailable("certificate verify failed")
            await super().register(state, ttl_s)

        async def publish(self, state: ReplicaState, ttl_s: float) -> None:
            if self.down:
                raise FleetStoreUnavailable("certificate verify failed")
            await super().publish(state, ttl_s)

    def logged(level: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == level]

    store = FlakyStore()
    agent = ReplicaAgent(
        AgentConfig(replica_id="pool/r0", engine_url="http://127.0.0.1:9", listen_port=None),
        index=MemoryBlockIndex(), fleet=store,
    )
    caplog.set_level("DEBUG")
    try:
        for _ in range(3):
            await agent.publish_state()
        (warning,) = logged("WARNING")
        assert "cannot register in the fleet store (certificate verify failed)" in warning
        store.down = False
        await agent.publish_state()
        assert [r.replica_id for r in await store.list_replicas()] == ["pool/r0"]
        assert any("registered in the fleet store again" in m for m in logged("INFO"))
        store.down = True
        await agent.publish_state()
        assert len(logged("WARNING")) == 2  # a new outage is told again
    finally:
        await agent.scraper.close()


@pytest.mark.parametrize(
    "sample",
    [
        "vllm:num_requests_running +Inf",
        "vllm:num_requests_waiting NaN",
        "vllm:num_requests_waiting 1.8446744073709552e+19",
        "vllm:num_preemptions_total -1",
        'vllm:kv_cache_usage_perc{engine="0"} NaN',
    ],
)
def test_a_figure_no_engine_reports_is_a_scrape_glitch(sample: str) -> None:
    """The routing review of session 46: ``int(inf)`` raised ``OverflowError``, which ended the
    agent's scrape loop (and its heartbeat) for good; a NaN KV usage read as an empty cache."""
    with pytest.raises(ValueError, match="scrape glitch"):
        parse_metrics(f"{sample}\nvllm:num_requests_waiting 0\n")


async def test_an_unreadable_page_keeps_the_agents_last_figures_and_it_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from replica.agent import ReplicaAgent
    from replica.agent.scrape import EngineSnapshot
    from routing.index import MemoryBlockIndex

    agent = ReplicaAgent(
        AgentConfig(replica_id="pool/r0", engine_url="http://127.0.0.1:9", listen_port=None),
        index=MemoryBlockIndex(), fleet=MemoryFleetStore(),
    )
    pages = iter(["vllm:num_requests_running 3\n", "vllm:num_requests_running +Inf\n"] * 2)

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot(**parse_metrics(next(pages)))

    try:
        agent.scraper.snapshot = snapshot  # type: ignore[method-assign]
        await agent._read_figures()
        assert agent.snapshot.running == 3
        for _ in range(3):  # unreadable, read, unreadable: said once a spell, never raised
            await agent._read_figures()
            assert agent.snapshot.running == 3
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(said) == 2 and "unreadable" in said[0]
    finally:
        await agent.scraper.close()


async def test_a_stored_state_with_an_absurd_figure_is_left_out_not_the_fleet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The routing review of session 46: a stored count past 2**63 reached the gateway's fleet
    arrays and failed every request; a corrupt entry made the whole store unreadable."""
    import json

    store = MemoryFleetStore()
    good = ReplicaState(ReplicaId("pool/good"), "http://good")
    await store.publish(good, 60.0)
    bad = json.loads(state_to_json(ReplicaState(ReplicaId("pool/bad"), "http://bad")))
    for field, value in [("waiting", 2**64 - 1), ("running", -1), ("kv_usage", "full"),
                         ("decode_step_ms", float("nan")), ("max_model_len", True)]:
        raw = json.dumps({**bad, field: value})
        with pytest.raises(ValueError, match=field):
            state_from_json(raw)
    store._states[ReplicaId("pool/bad")] = (float("inf"), json.dumps({**bad, "waiting": 2**64}))
    for _ in range(3):
        assert [s.replica_id for s in await store.list_replicas()] == ["pool/good"]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "left out" in said[0] and "waiting" in said[0]
