"""`fleetgate advise --verify`: today's and the advised flags through the simulator."""

from __future__ import annotations

from planning.advise import EngineFlags, Measurements, PoolSnapshot, advise
from planning.advise.verify import _configs, engine_overrides, synthetic_trace, verify

POOL = PoolSnapshot(
    "tiny",
    EngineFlags(
        max_model_len=4096,
        block_size=16,
        num_gpu_blocks=256,
        max_num_seqs=16,
        sources={"num_gpu_blocks": "engine-reported"},
    ),
    Measurements(
        requests=500,
        request_rate_per_s=20.0,
        context_p99=700,
        context_max=768,
        prompt_mean=300,
        prompt_p99=600,
        output_mean=40,
        output_p99=100,
        kv_usage=0.97,
        waiting_mean=4.0,
        preemptions_per_min=0,
    ),
    replicas=2,
    hardware="l4",
    model="tiny",
    sim_profile="tiny",
)


def test_synthetic_trace_follows_the_measurements() -> None:
    records = synthetic_trace(POOL, 400, seed=1)
    assert len(records) == 400
    assert all(r.input_length + r.output_length <= 768 for r in records)
    mean_prompt = sum(r.input_length for r in records) / len(records)
    assert 200 < mean_prompt < 400
    span_s = (records[-1].timestamp - records[0].timestamp) / 1000
    assert 14 < len(records) / span_s < 26  # ~20 req/s


def test_advised_engine_starts_from_the_reported_blocks_scaled_by_the_change() -> None:
    rows = advise(POOL)
    today, advised, preset = _configs(POOL, rows)
    assert preset == "tiny"
    assert today["num_gpu_blocks_override"] == 256
    assert advised["kv_dtype"] == "fp8" and advised["num_gpu_blocks_override"] == 512
    assert advised["max_model_len"] < today["max_model_len"] == 4096
    assert engine_overrides(POOL.flags.with_defaults())["max_num_seqs"] == 16


def test_verify_prints_both_rows() -> None:
    rows = advise(POOL)
    result = verify(POOL, rows, synthetic_trace(POOL, 120), slo_tpot_ms=200.0)
    assert [r.flags for r in result] == ["today", "advised"]
    assert all(r.requests == 120 and r.goodput is not None for r in result)


def test_verify_replays_only_the_first_requests_of_a_trace(tmp_path, capsys) -> None:
    """`--requests N` with `--trace`: the first N, so a bad line past them does not stop it (the
    whole trace was read, whatever its length)."""
    from fleetgate.cli import main

    line = '{"timestamp": %d, "input_length": 300, "output_length": 20, "hash_ids": [%d]}\n'
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(line % (i * 50, i) for i in range(40)) + "not json\n")
    argv = ["advise", "--input", "docs/advise/rag-pool.yaml", "--verify", "--trace", str(trace)]
    assert main([*argv, "--requests", "40", "--json"]) == 0
    assert '"requests": 40' in capsys.readouterr().out
    assert main(argv) == 2  # read whole: the bad line is named
    assert f"--trace: {trace}:41: not valid JSON" in capsys.readouterr().err
