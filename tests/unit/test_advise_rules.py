"""`fleetgate advise` rules on recorded snapshots: each must-show case gets its flag and value.

The fixtures under tests/unit/fixtures/advise/ are snapshots in the `--save` format: an
oversized --max-model-len, a pool preempting at its --max-num-seqs, a pool thrashing adapters,
an FP8-capable pool with KV pinned, and a healthy pool.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planning.advise import Advice, EngineFlags, Measurements, PoolSnapshot, advise, changes
from planning.advise.batch import nice_floor
from planning.advise.decide import FLAGS
from planning.advise.snapshot import load_snapshot, parse_snapshot, to_mapping

FIXTURES = Path(__file__).parent / "fixtures" / "advise"


def _advice(name: str) -> tuple[PoolSnapshot, list[Advice]]:
    (pool,) = load_snapshot(FIXTURES / f"{name}.json").values()
    return pool, advise(pool)


def _row(rows: list[Advice], flag: str) -> Advice:
    return next(row for row in rows if row.flag == flag)


def test_every_flag_gets_one_row_in_order() -> None:
    _pool, rows = _advice("healthy")
    assert [row.flag for row in rows] == list(FLAGS)


def test_oversized_max_model_len_is_cut_to_the_measured_p99() -> None:
    pool, rows = _advice("oversized_max_model_len")
    assert changes(rows) == {"--max-model-len": 3648}
    row = _row(rows, "--max-model-len")
    # max(p99 2910 x 1.25 = 3637.5, longest 3072), up to a 16-token block.
    assert row.advised == 3648 and row.advised % 16 == 0
    assert row.advised >= pool.measured.context_max
    assert row.current == 131072 and row.current_source == "engine-reported"
    assert "2,910" in row.evidence
    # 27,000 blocks: 27000 // 8192 = 3 max-length sequences today, 27000 // 228 = 118 advised.
    assert "8,192 -> 228 blocks" in row.effect and "3 -> 118" in row.effect


@pytest.mark.parametrize(("requests", "cut"), [(1, False), (9, False), (10, True), (None, True)])
def test_max_model_len_is_cut_only_on_enough_requests_for_a_p99(
    requests: int | None, cut: bool
) -> None:
    # One observed request once cut 131,072 to 16 (the CLI review). An unknown count (a
    # snapshot that does not say) is judged on its lengths as before.
    pool, _rows = _advice("oversized_max_model_len")
    few = replace(pool, measured=replace(pool.measured, requests=requests))
    row = _row(advise(few), "--max-model-len")
    assert (row.kind != "no change") == cut
    if not cut:
        assert "too few requests" in row.evidence


def test_pool_preempting_at_max_num_seqs_gets_a_lower_cap() -> None:
    _pool, rows = _advice("preempting_at_max_num_seqs")
    assert changes(rows) == {"--max-num-seqs": 224}  # 90% of 256, a multiple of 8
    assert "running = 256 (measured)" in _row(rows, "--max-num-seqs").evidence
    # KV is pinned, but an A100 has no FP8: no FP8 KV advice.
    assert _row(rows, "--kv-cache-dtype").kind == "no change"


def test_preemption_onset_estimated_from_kv_when_not_observed() -> None:
    pool, _rows = _advice("preempting_at_max_num_seqs")
    measured = replace(pool.measured, running_at_preemption=None)
    rows = advise(replace(pool, measured=measured))
    row = _row(rows, "--max-num-seqs")
    # 20,000 blocks / ceil((900 + 350) / 16) = 79 blocks per request = 253 sequences -> 224.
    assert row.kind == "change" and row.advised == 224
    assert "estimated" in row.evidence


def test_thrashing_adapters_get_slots_for_the_working_set() -> None:
    _pool, rows = _advice("thrashing_adapters")
    assert changes(rows) == {"--max-loras": 12, "--max-cpu-loras": 12}
    assert "400 KV blocks" in _row(rows, "--max-loras").effect  # 10 slots x 84 MB / 2 MiB blocks


def test_fp8_capable_pool_with_kv_pinned_gets_fp8_kv() -> None:
    _pool, rows = _advice("fp8_capable_kv_pinned")
    assert changes(rows) == {"--kv-cache-dtype": "fp8"}
    row = _row(rows, "--kv-cache-dtype")
    assert row.current == "auto" and row.current_source == "engine-reported"
    assert "26,500 -> 53,000 blocks" in row.effect  # exactly 2x
    # Weights come after the KV cache.
    assert "FP8 KV first" in _row(rows, "--quantization").evidence


def test_healthy_pool_gets_no_change() -> None:
    _pool, rows = _advice("healthy")
    assert changes(rows) == {}
    assert {row.kind for row in rows} == {"no change"}


def test_kv_full_with_empty_queue_is_not_pinned() -> None:
    pool, _rows = _advice("fp8_capable_kv_pinned")
    calm = replace(pool.measured, waiting_mean=0.0, waiting_growth_per_min=0.0)
    assert "--kv-cache-dtype" not in changes(advise(replace(pool, measured=calm)))


def test_fp8_kv_then_fp8_weights() -> None:
    pool, _rows = _advice("fp8_capable_kv_pinned")
    flags = replace(pool.flags, kv_cache_dtype="fp8")
    rows = advise(replace(pool, flags=flags))
    assert changes(rows) == {"--quantization": "fp8"}


def test_lowered_gpu_memory_utilization_is_raised_when_pinned() -> None:
    pool, _rows = _advice("fp8_capable_kv_pinned")
    flags = replace(pool.flags, gpu_memory_utilization=0.6)
    assert changes(advise(replace(pool, flags=flags)))["--gpu-memory-utilization"] == 0.9


def test_oversized_tp_is_cut_to_the_smallest_that_fits() -> None:
    pool, _rows = _advice("healthy")
    flags = replace(pool.flags, tensor_parallel_size=4)
    row = _row(advise(replace(pool, flags=flags)), "--tensor-parallel-size")
    assert row.kind == "change" and row.advised == 1


def test_70b_needs_tp_and_tp_is_capped_at_kv_heads() -> None:
    flags = EngineFlags(max_model_len=8192, tensor_parallel_size=1, block_size=16)
    pool = PoolSnapshot("big", flags, Measurements(), hardware="h100-sxm", model="llama3-70b")
    row = _row(advise(pool), "--tensor-parallel-size")
    assert row.kind == "change" and row.advised == 2  # 141 GB of bf16 weights: 2 x 80 GB
    assert "will not start" in row.evidence


def test_prefix_caching_off_is_turned_on_never_off() -> None:
    pool, _rows = _advice("healthy")
    off = replace(pool.flags, enable_prefix_caching=False)
    assert changes(advise(replace(pool, flags=off))) == {"--enable-prefix-caching": True}


def test_unknown_inputs_are_not_checked_and_defaults_are_marked() -> None:
    rows = advise(PoolSnapshot("bare", EngineFlags(), Measurements()))
    assert _row(rows, "--max-model-len").kind == "not checked"
    assert _row(rows, "--tensor-parallel-size").kind == "not checked"
    assert _row(rows, "--max-num-seqs").current_source == "assumed default"


@pytest.mark.parametrize(("value", "expected"), [(230.4, 224), (14.4, 14), (0.5, 1), (16, 16)])
def test_nice_floor(value: float, expected: int) -> None:
    assert nice_floor(value) == expected


def test_snapshot_round_trips_through_save_format() -> None:
    pools = load_snapshot(FIXTURES / "healthy.json")
    again = parse_snapshot(to_mapping(pools))
    assert again == pools
    assert again["internal"].measured.timers == pools["internal"].measured.timers


def test_triage_levers_that_name_a_flag_carry_the_advised_value() -> None:
    from planning.triage import RouteMetrics, triage
    from planning.triage.flags import annotate

    _pool, rows = _advice("fp8_capable_kv_pinned")
    levers = annotate(triage(RouteMetrics(kv_cache_usage=0.96, waiting_mean=9.0)), {"rag": rows})
    kv = next(lever for lever in levers if lever.category == "kv-quantization")
    assert kv.why.endswith("fleetgate advise: pool rag: --kv-cache-dtype auto -> fp8")
    # The weight lever names vLLM's flag, so it carries advise's verdict too (FP8 KV first).
    weights = next(lever for lever in levers if lever.category == "weight-quantization")
    assert "--quantization fp8" in weights.action
    assert weights.why.endswith("fleetgate advise: pool rag: --quantization none (no change)")
