"""Generated traces: deterministic, prefix-chain shapes as advertised, rates roughly right."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter

import pytest

from bench.workloads import SHAPES, BurstParams, generate
from bench.workloads.__main__ import main
from bench.workloads.shapes import chat, lora, rag
from traces.format import blocks_for, read_trace

BLOCK = 512


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arrival", ["poisson", "bursty"])
def test_same_seed_same_trace_other_seed_other_trace(shape: str, arrival: str) -> None:
    first = generate(shape, 200, 5.0, arrival, BLOCK, seed=7)
    assert first == generate(shape, 200, 5.0, arrival, BLOCK, seed=7)
    assert first != generate(shape, 200, 5.0, arrival, BLOCK, seed=8)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_records_are_well_formed(shape: str) -> None:
    records = generate(shape, 300, 20.0, "poisson", BLOCK, seed=1)
    assert [r.timestamp for r in records] == sorted(r.timestamp for r in records)
    for record in records:
        assert len(record.hash_ids) == blocks_for(record.input_length, BLOCK)
        assert record.output_length >= 1


def test_arrival_process_does_not_change_the_prompts() -> None:
    poisson = generate("rag", 100, 5.0, "poisson", BLOCK, seed=3)
    bursty = generate("rag", 100, 5.0, "bursty", BLOCK, seed=3)
    assert [r.hash_ids for r in poisson] == [r.hash_ids for r in bursty]
    assert [r.timestamp for r in poisson] != [r.timestamp for r in bursty]


@pytest.mark.parametrize("block_size", [256, 512])
def test_rag_records_share_the_system_prompt_blocks(block_size: int) -> None:
    shared = rag.SYSTEM_PROMPT_TOKENS // block_size
    records = generate("rag", 200, 5.0, "poisson", block_size, seed=2)
    first = records[0].hash_ids[:shared]
    assert all(r.hash_ids[:shared] == first for r in records)
    # The block after the system prompt mixes in retrieved chunks, so it is not shared by all.
    assert len({r.hash_ids[shared] for r in records}) > 1


def test_cache_buster_shares_no_first_block() -> None:
    records = generate("rag-cache-buster", 300, 5.0, "poisson", BLOCK, seed=2)
    assert len({r.hash_ids[0] for r in records}) == len(records)
    # And, since ids form a chain, no id at all repeats across requests.
    counts = Counter(h for r in records for h in r.hash_ids)
    assert max(counts.values()) == 1


def test_multi_turn_turns_extend_the_previous_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # With one open session, consecutive records are consecutive turns of the same chat.
    monkeypatch.setattr(chat, "OPEN_SESSIONS", 1)
    records = generate("multi-turn", 400, 5.0, "poisson", BLOCK, seed=4)
    follow_ups = 0
    for prev, record in itertools.pairwise(records):
        full = prev.input_length // BLOCK
        extends = record.hash_ids[:full] == prev.hash_ids[:full]
        # The next turn re-sends the previous prompt and its answer, plus a new user message.
        grew = record.input_length > prev.input_length + prev.output_length
        if extends and grew:
            follow_ups += 1
        else:
            # Otherwise a new chat starts: only the system prompt's full blocks are shared.
            shared = chat.SYSTEM_PROMPT_TOKENS // BLOCK
            assert record.hash_ids[:shared] == records[0].hash_ids[:shared]
            assert record.hash_ids[shared] not in prev.hash_ids
    # Sessions last MEAN_TURNS turns on average, so ~80% of records are follow-ups.
    expected = 1 - 1 / chat.MEAN_TURNS
    assert follow_ups / (len(records) - 1) == pytest.approx(expected, abs=0.1)


def test_agent_steps_share_one_of_a_few_few_shot_prefixes() -> None:
    records = generate("agent", 300, 5.0, "poisson", BLOCK, seed=5)
    first_blocks = Counter(r.hash_ids[0] for r in records)
    # Few-shot prefixes are >= 800 tokens, so the first block is always the prefix's.
    assert len(first_blocks) <= 4
    assert sum(first_blocks.values()) == len(records)


def test_b2b_traffic_is_zipf_across_forty_adapters() -> None:
    records = generate("b2b-lora", 4000, 50.0, "poisson", BLOCK, seed=6)
    counts = Counter(r.adapter for r in records)
    assert set(counts) <= {lora.adapter_name(rank) for rank in range(lora.ADAPTERS)}
    assert len(counts) > 30
    # Zipf: the busiest adapter gets several times the traffic of the median one.
    ranked = [n for _, n in counts.most_common()]
    assert counts[lora.adapter_name(0)] == ranked[0]
    assert ranked[0] > 5 * statistics.median(ranked)
    # Prefixes never cross adapters (the adapter is part of vLLM's block hash).
    first_block_adapter = {}
    for record in records:
        assert first_block_adapter.setdefault(record.hash_ids[0], record.adapter) == record.adapter


@pytest.mark.parametrize("arrival", ["poisson", "bursty"])
@pytest.mark.parametrize("rate", [2.0, 25.0])
def test_mean_rate_is_roughly_the_requested_rate(arrival: str, rate: float) -> None:
    # Long enough to span many burst cycles; the fixed seed makes this repeatable.
    burst = BurstParams(cycle_s=20.0)
    records = generate("b2b-lora", 6000, rate, arrival, BLOCK, seed=11, burst=burst)
    observed = len(records) / (records[-1].timestamp / 1000)
    assert observed == pytest.approx(rate, rel=0.2)


def test_bursty_counts_are_overdispersed_and_poisson_counts_are_not() -> None:
    def dispersion(arrival: str) -> float:
        records = generate("rag", 6000, 10.0, arrival, BLOCK, seed=12)
        per_second = Counter(r.timestamp // 1000 for r in records)
        counts = [per_second.get(s, 0) for s in range(records[-1].timestamp // 1000)]
        return statistics.variance(counts) / statistics.mean(counts)

    # Poisson counts have variance = mean; the on/off process is far burstier.
    assert dispersion("poisson") < 1.5
    assert dispersion("bursty") > 3.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shape": "nope"}, "unknown shape 'nope'"),
        ({"arrival": "uniform"}, "unknown arrival process 'uniform'"),
        ({"rate": 0.0}, "rate must be > 0"),
        ({"requests": 0}, "requests must be >= 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    args = {"shape": "rag", "requests": 10, "rate": 1.0, "arrival": "poisson"} | kwargs
    with pytest.raises(ValueError, match=message):
        generate(**args)


@pytest.mark.parametrize(
    ("peak", "on_fraction", "message"),
    [(0.5, 0.25, "peak must be >= 1"), (3.0, 1.0, "on_fraction"), (5.0, 0.5, "<= 1")],
)
def test_impossible_burst_shapes_are_refused(peak: float, on_fraction: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BurstParams(peak=peak, on_fraction=on_fraction)


def test_cli_writes_a_readable_trace(tmp_path) -> None:
    out = tmp_path / "t.jsonl"
    argv = ["agent", "--requests", "50", "--rate", "3", "--out", str(out), "--seed", "9"]
    assert main(argv) == 0
    assert read_trace(out, block_size=BLOCK) == generate("agent", 50, 3.0, seed=9)


def test_cli_refuses_bad_burst_settings(capsys) -> None:
    argv = ["rag", "--requests", "5", "--rate", "1", "--out", "-", "--arrival", "bursty"]
    with pytest.raises(SystemExit):
        main([*argv, "--burst-peak", "9"])
    assert "peak × on_fraction must be <= 1" in capsys.readouterr().err
