"""The simulator's parts: prompt synthesis and the engine->routing hash map, adapter specs."""

from __future__ import annotations

import pytest

from planning.simulator import SimulationConfig, parse_adapter_spec, prepare_requests, simulate
from planning.simulator.prompts import PromptFactory
from replica.sim.engine import EngineConfig, EngineModel, SimRequest
from traces.format import TraceRecord


def _factory(trace_block: int = 64, engine_block: int = 16) -> PromptFactory:
    return PromptFactory("m", trace_block, engine_block, vocab_size=32000)


def test_equal_ids_give_equal_tokens_and_different_ids_different_ones() -> None:
    factory = _factory()
    a = factory.tokens((1, 2), 128)
    b = factory.tokens((1, 3), 100)
    assert a[:64] == b[:64]
    assert a[64:100] != b[64:100]
    assert len(b) == 100
    assert factory.tokens((1, 2), 128) == a  # deterministic


def test_routing_chain_covers_full_trace_blocks_and_depends_on_adapter() -> None:
    factory = _factory()
    plain = factory.prepare((1, 2, 3), 150, None)  # two full blocks and a partial one
    tuned = factory.prepare((1, 2, 3), 150, "ft-a")
    assert len(plain.chain) == 2
    assert set(plain.chain).isdisjoint(tuned.chain)
    assert factory.prepare((1, 2, 9), 192, None).chain[:2] == plain.chain


def test_engine_kv_events_map_to_the_routing_chain() -> None:
    factory = _factory()
    prompt = factory.prepare((5, 6, 7), 192, "ft-a")
    config = EngineConfig.from_profile("tiny")
    engine = EngineModel(config)
    engine.register_adapter("ft-a")
    engine.submit(SimRequest("r", prompt.token_ids, 2, adapter="ft-a"))
    stored: list[int] = []
    now = 0.0
    while engine.has_work():
        result = engine.step(now)
        now += result.duration_s
        for event in result.kv_events:
            if event.kind == "BlockStored":
                stored.extend(event.block_hashes)
    mapped = [factory.routing_hash_of[h] for h in stored if h in factory.routing_hash_of]
    # Each trace block is announced by exactly one engine block: its last.
    assert mapped == list(prompt.chain)


def test_block_sizes_must_nest() -> None:
    with pytest.raises(ValueError, match="multiple of the engine's block_size"):
        PromptFactory("m", 500, 16, 32000)


def test_too_few_hash_ids_for_the_length_is_an_error() -> None:
    with pytest.raises(ValueError, match="--trace-block-size"):
        _factory().tokens((1,), 100)


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("uniform:3", ["ft-0", "ft-1", "ft-2"]),
        ("zipf:2:1.5", ["ft-0", "ft-1"]),
        ("a=1,base=3", ["a"]),
    ],
)
def test_adapter_specs(spec: str, names: list[str]) -> None:
    assert parse_adapter_spec(spec).adapters == names


# NaN or infinite weights sent every request to one adapter (the CLI review).
@pytest.mark.parametrize(
    "spec",
    ["uniform:0", "zipf:x", "a=1,b", "a=-1", "base=0", "a=nan,b=1", "a=inf,b=1", "zipf:4:nan"],
)
def test_bad_adapter_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--adapters"):
        parse_adapter_spec(spec)


def test_adapters_follow_the_first_block_and_trace_adapters_win() -> None:
    mix = parse_adapter_spec("uniform:8")
    records = [TraceRecord(i, 64, 2, (i % 4, 100 + i)) for i in range(40)]
    records.append(TraceRecord(40, 64, 2, (0, 999), adapter="mine"))
    requests = prepare_requests(records, adapters=mix, seed=1)
    by_first: dict[int, set[str | None]] = {}
    for request in requests[:40]:
        by_first.setdefault(request.record.hash_ids[0], set()).add(request.adapter)
    assert all(len(adapters) == 1 for adapters in by_first.values())
    assert len({a for s in by_first.values() for a in s}) > 1
    assert requests[40].adapter == "mine"


def test_lora_requests_run_and_stale_stats_still_route() -> None:
    records = [TraceRecord(i * 50, 128, 3, (i % 3, 50 + i)) for i in range(12)]
    requests = prepare_requests(records, adapters=parse_adapter_spec("uniform:3"), seed=0)
    config = SimulationConfig(
        replicas=2,
        profile="tiny",
        trace_block_size=64,
        stats_interval_s=1.0,
        engine_overrides={"num_gpu_blocks_override": 1024},
    )
    report = simulate(requests, ["expected-ttft"], config)
    assert report.summaries[0].requests == 12
    assert report.runs["expected-ttft"].rejected == 0
