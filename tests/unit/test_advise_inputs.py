"""`fleetgate advise` inputs: engine metrics text, samples over a window, snapshots, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetgate.cli import main
from planning.advise.engine_metrics import (
    Histogram,
    flags_of,
    max_model_len_of,
    parse_engine_metrics,
)
from planning.advise.measure import Lengths, Sample, context_bounds, measurements
from planning.advise.model import AdviceError, EngineFlags, PoolSnapshot
from planning.advise.render import timer_table
from planning.advise.snapshot import parse_snapshot

FIXTURES = Path(__file__).parent / "fixtures" / "advise"

# A trimmed vLLM /metrics: the info gauges, the gauges and one timer.
VLLM_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.93
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} PREEMPT
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="fp8",enable_prefix_caching="False",\
engine="0",gpu_memory_utilization="0.85",num_gpu_blocks="112"} 1.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 10.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,c",waiting_lora_adapters="d"} 20.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 5.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="1.0",model_name="tiny"} 10.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 10.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 3.0
"""


def _reading(preemptions: int = 0, running: int = 7, waiting: int = 3):
    text = VLLM_TEXT.replace("PREEMPT", str(preemptions))
    text = text.replace('model_name="tiny"} 7.0', f'model_name="tiny"}} {running}.0')
    text = text.replace('model_name="tiny"} 3.0', f'model_name="tiny"}} {waiting}.0')
    return parse_engine_metrics(text)


def test_engine_metrics_give_engine_reported_flags() -> None:
    reading = _reading()
    assert reading.adapters == {"b", "c", "d"}  # the latest lora_requests_info series
    flags = flags_of(reading, max_model_len_of({"data": [{"id": "tiny", "max_model_len": 2048}]}))
    assert flags == EngineFlags(
        max_model_len=2048,
        block_size=32,
        num_gpu_blocks=112,
        kv_cache_dtype="fp8",
        enable_prefix_caching=False,
        gpu_memory_utilization=0.85,
        enable_lora=True,
        max_loras=2,
    )
    assert {flags.source(name) for name in flags.sources} == {"engine-reported"}


def test_samples_give_queue_growth_preemption_onset_and_timers() -> None:
    samples = [
        Sample(0.0, [_reading(preemptions=0, running=5, waiting=1)]),
        Sample(30.0, [_reading(preemptions=4, running=12, waiting=4)]),
        Sample(60.0, [_reading(preemptions=6, running=14, waiting=7)]),
    ]
    m = measurements(samples, None)
    assert m.preemptions_per_min == 6.0
    assert m.running_at_preemption == 12  # the lowest running level at which the counter moved
    assert m.running_peak == 14
    assert m.waiting_growth_per_min == 6.0
    assert m.kv_usage == pytest.approx(0.93)
    assert m.adapter_working_set == 3
    assert m.timers["prefill"].p50_ms == pytest.approx(100.0)
    # Half the prefills are in the 0-100 ms bucket: p50 is "at most 100 ms", not a figure
    # made up by interpolating from 0 (the review's idle fleet: queue p50 150 ms, TTFT 13 ms).
    assert m.timers["prefill"].at_most == ("p50_ms",)
    assert m.timers["prefill"].p95_ms == pytest.approx(910.0)  # interpolated in 0.1-1 s
    table = "\n".join(timer_table(PoolSnapshot("p", EngineFlags(), m)))
    assert "<=100" in table and "first bucket" in table


def test_one_scrape_of_a_counter_at_zero_is_zero_per_minute() -> None:
    assert measurements([Sample(0.0, [_reading(preemptions=0)])], None).preemptions_per_min == 0
    assert measurements([Sample(0.0, [_reading(preemptions=3)])], None).preemptions_per_min is None


def _hist(buckets: dict[float, float]) -> Histogram:
    hist = Histogram()
    hist.buckets.update(buckets)
    hist.count = max(buckets.values())
    return hist


def test_context_bounds_take_the_tightest_histogram() -> None:
    # 100 requests: prompts 200-256 tokens, 8 output tokens; the context histogram alone would
    # put its p99 deep in the 256-512 bucket.
    prompt = _hist({128.0: 0, 256.0: 100, float("inf"): 100})
    output = _hist({8.0: 100, 16.0: 100, float("inf"): 100})
    context = _hist({256.0: 40, 512.0: 100, float("inf"): 100})
    p99, top = context_bounds(Lengths(prompt, output, context))
    assert top == 256 + 8
    assert p99 <= top


def test_window_histogram_subtracts_the_earlier_reading() -> None:
    later = _hist({10.0: 5, 100.0: 9})
    earlier = _hist({10.0: 4, 100.0: 4})
    assert dict(later.since(earlier).buckets) == {10.0: 1, 100.0: 5}


def test_bad_snapshots_name_the_path() -> None:
    with pytest.raises(AdviceError, match=r"input.pools.p.flags.max_num_seqs: must be an integer"):
        parse_snapshot({"pools": {"p": {"flags": {"max-num-seqs": "many"}}}})
    with pytest.raises(AdviceError, match=r"input.pools.p.flags.max_batch: unknown flag"):
        parse_snapshot({"pools": {"p": {"flags": {"max_batch": 3}}}})
    with pytest.raises(AdviceError, match=r"measured.kv_usage: must be \[0, 1\]"):
        parse_snapshot({"pools": {"p": {"measured": {"kv_usage": 96}}}})


def test_cli_json_and_flags_overlay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = tmp_path / "flags.yaml"
    flags.write_text("max-num-seqs: 64\n")
    code = main(
        [
            "advise",
            "--input",
            str(FIXTURES / "healthy.json"),
            "--flags",
            f"internal={flags}",
            "--json",
        ]
    )
    assert code == 0
    rows = {r["flag"]: r for r in json.loads(capsys.readouterr().out)["internal"]["advice"]}
    assert rows["--max-num-seqs"]["current"] == 64
    assert rows["--max-num-seqs"]["current_source"] == "given"
    assert {r["advice"] for r in rows.values()} == {"no change"}


def test_cli_changes_only_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["advise", "--input", str(FIXTURES / "oversized_max_model_len.json"), "--changes-only"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--max-model-len 131,072 [engine-reported] -> 3648" in out
    assert "--kv-cache-dtype" not in out
    bad = tmp_path / "bad.json"
    bad.write_text('{"pools": {"p": {"replicas": 0}}}')
    assert main(["advise", "--input", str(bad)]) == 2
    assert "replicas: must be an integer >= 1" in capsys.readouterr().err
