"""`fleetgate advise` fixes from the planning review: requested max_tokens bound the length cut,
vLLM's batch defaults follow the GPU, unknown quantization methods are not read as bf16, and
snapshots read numbers written with an exponent."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.metrics import GatewayMetrics
from planning.advise import Advice, EngineFlags, Measurements, PoolSnapshot, advise, changes
from planning.advise.live import _lengths, parse_gateway
from planning.advise.measure import Sample, measurements
from planning.advise.model import batch_defaults
from planning.advise.prometheus_source import fetch_prometheus_pools
from planning.advise.sizing import weight_dtype_of
from planning.advise.snapshot import load_snapshot, parse_snapshot, to_mapping
from planning.advise.verify import _configs

FIXTURES = Path(__file__).parent / "fixtures" / "advise"


def _row(rows: list[Advice], flag: str) -> Advice:
    return next(row for row in rows if row.flag == flag)


def _oversized() -> PoolSnapshot:
    (pool,) = load_snapshot(FIXTURES / "oversized_max_model_len.json").values()
    return pool


# --------------------------------------------------------------- 1: requested max_tokens


def test_requested_budget_is_a_floor_of_the_advised_max_model_len() -> None:
    # p99 2,910 alone gives 3,648; a 1,400-token prompt asking max_tokens 4,096 (5,496, in the
    # 6,144 bucket) would be refused by vLLM at 3,648. The floor keeps it served.
    pool = _oversized()
    asked = replace(pool, measured=replace(pool.measured, requested_context_max=6144.0))
    row = _row(advise(asked), "--max-model-len")
    assert row.kind == "change" and row.advised == 6144
    assert "requested max_tokens ≤ 6,144" in row.evidence
    assert "not measured" not in row.evidence


def test_requested_budget_near_today_keeps_the_flag() -> None:
    pool = _oversized()
    asked = replace(pool, measured=replace(pool.measured, requested_context_max=131072.0))
    assert "--max-model-len" not in changes(advise(asked))


def test_unmeasured_budget_warns_that_the_cut_may_refuse_requests() -> None:
    row = _row(advise(_oversized()), "--max-model-len")
    assert row.kind == "change" and row.advised == 3648
    assert "max_tokens were not measured" in row.evidence
    assert "may refuse requests that ask for long outputs" in row.evidence


def test_lengths_reaching_past_the_flag_say_that_vllm_refuses_such_requests() -> None:
    """The second planning review: prompt + requested max_tokens up to 8,000 against
    --max-model-len 4,096 said "no change" and nothing of refusals. The lengths are bucket
    bounds, so the row keeps the flag (the diff review: a raise advised from a bucket edge where
    no request was over it) and says what to check."""
    pool = _oversized()
    flags = replace(pool.flags, max_model_len=4096)
    asked = replace(
        pool, flags=flags, measured=replace(pool.measured, requested_context_max=8000.0)
    )
    row = _row(advise(asked), "--max-model-len")
    assert row.kind == "no change"
    assert "vLLM answers 400" in row.evidence and "fleetgate_requests_total" in row.evidence


def _gateway_text() -> str:
    from prometheus_client import generate_latest

    metrics = GatewayMetrics()
    for prompt, output, budget in ((1400, 180, 4096), (900, 120, None)):
        metrics.request_prompt_tokens.labels("chat", "gpu").observe(prompt)
        metrics.request_output_tokens.labels("chat", "gpu").observe(output)
        metrics.request_context_tokens.labels("chat", "gpu").observe(prompt + output)
        if budget is not None:
            metrics.request_budget_tokens.labels("chat", "gpu").observe(prompt + budget)
    return generate_latest(metrics.registry).decode()


def test_live_gateway_reading_gives_the_longest_requested_context() -> None:
    reading = parse_gateway(_gateway_text())
    lengths = _lengths(reading, "gpu", None)
    assert lengths is not None and lengths.budget is not None
    measured = measurements([Sample(0.0, [])], lengths)
    assert measured.context_max == 1536 + 256  # 1,580 generated: longest prompt + output bound
    assert measured.requested_context_max == 6144  # 5,496 asked for, in the 6,144 bucket


def test_prometheus_reads_the_longest_requested_context() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        promql = request.url.params["query"]
        series = []
        if "fleetgate_request_budget_tokens_bucket" in promql and 'le!="+Inf"' not in promql:
            assert promql.startswith("histogram_quantile(1, sum by (pool, le)")
            series = [{"metric": {"pool": "chat"}, "value": [0, "6144"]}]
        elif promql == "vllm:cache_config_info":
            series = [{"metric": {"pool": "chat"}, "value": [0, "1"]}]
        return httpx.Response(200, json={"status": "success", "data": {"result": series}})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        pools = fetch_prometheus_pools("http://prom:9090", client, window="10m")
    assert pools["chat"].measured.requested_context_max == 6144.0


def test_snapshot_field_is_optional_and_round_trips() -> None:
    old = {"pools": {"p": {"flags": {"max-model-len": 8192}, "measured": {"context_p99": 100}}}}
    assert parse_snapshot(old)["p"].measured.requested_context_max is None
    new = {"pools": {"p": {"measured": {"context_p99": 100, "requested_context_max": 4096}}}}
    pools = parse_snapshot(new)
    assert pools["p"].measured.requested_context_max == 4096
    assert parse_snapshot(to_mapping(pools)) == pools


# --------------------------------------------------------------- 2: vLLM's batch defaults


@pytest.mark.parametrize(
    ("hardware", "memory", "seqs", "tokens"),
    [
        ("h100-sxm", 80, 1024, 8192),
        ("h200", 141, 1024, 8192),
        ("a100-80gb", 80, 256, 2048),
        ("l4", 24, 256, 2048),
        (None, None, 256, 2048),
    ],
)
def test_batch_defaults_follow_the_gpu(
    hardware: str | None, memory: float | None, seqs: int, tokens: int
) -> None:
    assert batch_defaults(hardware, memory) == {
        "max_num_seqs": seqs,
        "max_num_batched_tokens": tokens,
    }


def _seqs_pool(hardware: str) -> PoolSnapshot:
    # The review's seqs.yaml: preempting at running 400, peak 430, --max-num-seqs not given.
    return PoolSnapshot(
        "chat",
        EngineFlags(max_model_len=8192, num_gpu_blocks=26500, kv_cache_dtype="fp8"),
        Measurements(
            kv_usage=0.97,
            waiting_mean=3,
            preemptions_per_min=12,
            running_at_preemption=400,
            running_peak=430,
            prompt_mean=1500,
            output_mean=200,
        ),
        replicas=2,
        hardware=hardware,
        model="llama3-8b",
    )


def test_h100_assumes_1024_seqs_and_cuts_to_90_percent_of_the_onset() -> None:
    row = _row(advise(_seqs_pool("h100-sxm")), "--max-num-seqs")
    assert row.current == 1024 and row.current_source == "assumed default"
    assert row.kind == "change" and row.advised == 360


def test_running_above_the_assumed_cap_says_the_assumption_is_wrong() -> None:
    # An A100 default of 256 cannot hold 430 running sequences: the engine has another cap.
    row = _row(advise(_seqs_pool("a100-80gb")), "--max-num-seqs")
    assert row.kind == "not checked" and row.advised is None
    assert "assumption is wrong" in row.evidence and "430" in row.evidence


def test_verify_simulates_today_at_the_gpus_default() -> None:
    now, _new, _preset = _configs(_seqs_pool("h100-sxm"), [])
    assert now["max_num_seqs"] == 1024 and now["max_num_batched_tokens"] == 8192


# --------------------------------------------------------------- 3: quantization methods


@pytest.mark.parametrize(
    ("method", "dtype"),
    [
        ("bitsandbytes", "int4"),
        ("mxfp4", "int4"),
        ("modelopt_fp4", "int4"),
        ("gptq_marlin_24", "int4"),
        ("awq_marlin", "int4"),
        ("fp8", "fp8"),
        (None, "bf16"),
        ("gguf", "unknown"),
        ("something-new", "unknown"),
    ],
)
def test_weight_dtype_of_quantization_methods(method: str | None, dtype: str) -> None:
    assert weight_dtype_of(method) == dtype


@pytest.mark.parametrize("method", ["bitsandbytes", "gguf", "mxfp4", "modelopt_fp4"])
def test_four_bit_models_are_never_told_to_upgrade_to_fp8(method: str) -> None:
    pool = _seqs_pool("h100-sxm")
    pool = replace(pool, flags=replace(pool.flags, quantization=method))
    rows = advise(pool)
    assert "--quantization" not in changes(rows)
    assert _row(rows, "--quantization").kind == "no change"
    tp = _row(rows, "--tensor-parallel-size")
    assert "bf16 weights" not in tp.evidence
    if method == "gguf":  # the checkpoint decides its width: no sizing from a guess
        assert tp.kind == "not checked"


def test_unknown_quantization_is_not_checked() -> None:
    pool = _seqs_pool("h100-sxm")
    pool = replace(pool, flags=replace(pool.flags, quantization="something-new"))
    rows = advise(pool)
    assert _row(rows, "--quantization").kind == "not checked"
    assert _row(rows, "--tensor-parallel-size").kind == "not checked"


# --------------------------------------------------------------- 5: exponent numbers


def test_snapshot_reads_exponent_numbers(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "pools:\n  a:\n    flags: {max-model-len: 8e3}\n    measured: {context_p99: 1.5e3}\n"
    )
    (pool,) = load_snapshot(path).values()
    assert pool.flags.max_model_len == 8000
    assert pool.measured.context_p99 == 1500


# ------------------------------------------- diff-rest review 2: chunked prefill off, --verify


def _nochunk_l4(**flags: object) -> PoolSnapshot:
    # The review's nochunk-l4.yaml: an L4 pool at --max-model-len 4096, chunked prefill off and
    # --max-num-batched-tokens not given (vLLM then runs with max(2048, 4096) = 4096).
    pool = load_snapshot(Path("docs/advise/rag-pool.yaml"))["rag"]
    given = {
        "max_model_len": 4096,
        "enable_chunked_prefill": False,
        "sources": {**pool.flags.sources, "enable_chunked_prefill": "given"},
        **flags,
    }
    measured = replace(pool.measured, context_max=4096.0, requested_context_max=4096.0)
    return replace(pool, hardware="l4", flags=replace(pool.flags, **given), measured=measured)


def test_chunked_prefill_off_assumes_batched_tokens_of_at_least_max_model_len() -> None:
    # vLLM's rule (EngineArgs._set_default_max_num_seqs_and_batched_tokens_args, 0.32).
    off = EngineFlags(max_model_len=4096, enable_chunked_prefill=False).with_defaults("l4", 24)
    assert off.max_num_batched_tokens == 4096
    assert off.source("max_num_batched_tokens") == "assumed default"
    short = EngineFlags(max_model_len=1024, enable_chunked_prefill=False).with_defaults("l4", 24)
    assert short.max_num_batched_tokens == 2048  # max(default, max_model_len)
    on = EngineFlags(max_model_len=4096).with_defaults("l4", 24)
    assert on.max_num_batched_tokens == 2048
    given = EngineFlags(
        max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=3000
    ).with_defaults("l4", 24)
    assert given.max_num_batched_tokens == 3000  # a given value is the engine's, never raised


def test_verify_with_chunked_prefill_off_simulates_what_vllm_runs() -> None:
    pool = _nochunk_l4()
    rows = advise(pool)
    assert changes(rows)["--enable-chunked-prefill"] is True
    now, new, _preset = _configs(pool, rows)  # raised ValueError: 2048 < 4096
    assert now["max_num_batched_tokens"] == 4096 and now["enable_chunked_prefill"] is False
    # The advised flags turn chunked prefill on: vLLM's default for them is the GPU's again.
    assert new["max_num_batched_tokens"] == 2048 and new["enable_chunked_prefill"] is True


def test_verify_flags_the_simulator_refuses_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fleetgate.cli import main

    # A *given* batch cap below --max-model-len with chunked prefill off: vLLM refuses it too.
    pool = _nochunk_l4(max_num_batched_tokens=2048)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(to_mapping({"rag": pool})))
    assert main(["advise", "--input", str(path), "--verify", "--requests", "20"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("fleetgate advise: error: pool rag: ")
    assert "max_num_batched_tokens (2048) must be >= max_model_len (4096)" in err


# ----------------------------------- diff-rest review 3: budgets past 131072 and the +Inf bucket


@pytest.mark.parametrize(
    ("budget", "longest"), [(200_000, 262144.0), (1_000_000, 1048576.0), (3_000_000, None)]
)
def test_live_reader_sees_long_budgets_and_reads_inf_as_unknown(
    budget: int, longest: float | None
) -> None:
    from prometheus_client import generate_latest

    metrics = GatewayMetrics()
    for name in ("prompt", "output", "context"):
        getattr(metrics, f"request_{name}_tokens").labels("chat", "gpu").observe(100)
    metrics.request_budget_tokens.labels("chat", "gpu").observe(4096)
    metrics.request_budget_tokens.labels("chat", "gpu").observe(budget)
    lengths = _lengths(parse_gateway(generate_latest(metrics.registry).decode()), "gpu", None)
    assert lengths is not None
    # Before: the buckets stopped at 131072, so 200k was in +Inf (unknown) even below 2M.
    assert measurements([Sample(0.0, [])], lengths).requested_context_max == longest


def test_length_buckets_reach_past_a_million_tokens() -> None:
    from gateway.metrics import _LENGTH_BUCKETS

    assert _LENGTH_BUCKETS[-1] >= 1_048_576 and 262144 in _LENGTH_BUCKETS
    assert list(_LENGTH_BUCKETS) == sorted(set(_LENGTH_BUCKETS))
    metrics = GatewayMetrics()
    for name in ("prompt", "output", "context", "budget"):
        getattr(metrics, f"request_{name}_tokens").labels("chat", "gpu").observe(200_000)
        value = metrics.registry.get_sample_value(
            f"fleetgate_request_{name}_tokens_bucket",
            {"route": "chat", "pool": "gpu", "le": "262144.0"},
        )
        assert value == 1, name


def _prometheus_with_overflow(overflow: dict[str, str]):
    def handler(request: httpx.Request) -> httpx.Response:
        promql = request.url.params["query"]
        series = []
        for kind, count in overflow.items():
            if f'fleetgate_request_{kind}_tokens_bucket{{le!="+Inf"}}' in promql:
                assert promql.startswith(
                    f'sum by (pool) (increase(fleetgate_request_{kind}_tokens_bucket{{le="+Inf"}}'
                )
                series = [{"metric": {"pool": "chat"}, "value": [0, count]}]
                break
        else:
            if "histogram_quantile(1, " in promql and "_tokens_bucket" in promql:
                # What Prometheus answers for a rank in +Inf: the top finite bound.
                series = [{"metric": {"pool": "chat"}, "value": [0, "131072"]}]
            elif "histogram_quantile(0.99, " in promql and "_tokens_bucket" in promql:
                series = [{"metric": {"pool": "chat"}, "value": [0, "3000"]}]
            elif promql == "vllm:cache_config_info":
                series = [{"metric": {"pool": "chat"}, "value": [0, "1"]}]
        return httpx.Response(200, json={"status": "success", "data": {"result": series}})

    return handler


def test_prometheus_reads_a_budget_over_the_top_bucket_as_unknown() -> None:
    handler = _prometheus_with_overflow(
        {"budget": "1.1", "context": "1.1", "prompt": "0", "output": "0"}
    )
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        pools = fetch_prometheus_pools("http://prom:9090", client, window="10m")
    measured = pools["chat"].measured
    assert measured.requested_context_max is None  # was 131072: below requests served
    # context_max falls back to the separate histograms' bound (longest prompt + output).
    assert measured.context_max == 131072 * 2
    flags = replace(pools["chat"].flags, max_model_len=262144, block_size=16)
    row = _row(advise(replace(pools["chat"], flags=flags)), "--max-model-len")
    assert "≤ 131,072" not in row.evidence
    if row.kind == "change":
        assert "max_tokens were not measured" in row.evidence


def test_prometheus_keeps_the_longest_when_nothing_is_over_the_top_bucket() -> None:
    handler = _prometheus_with_overflow(
        {"budget": "0", "context": "0", "prompt": "0", "output": "0"}
    )
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        pools = fetch_prometheus_pools("http://prom:9090", client, window="10m")
    assert pools["chat"].measured.requested_context_max == 131072
    assert pools["chat"].measured.context_max == 131072


# ----------------------------------------- diff-rest review 5: unquantized spelled out


@pytest.mark.parametrize(
    "method", ["none", "None", "NONE", "auto", "bf16", "bfloat16", "fp16", "float16"]
)
def test_unquantized_names_are_16_bit_weights(method: str) -> None:
    assert weight_dtype_of(method) == "bf16"
    # The review's q-none.yaml: KV pinned with an FP8 cache already -> FP8 weights, and TP sized.
    pool = load_snapshot(Path("docs/advise/rag-pool.yaml"))["rag"]
    flags = replace(pool.flags, quantization=method, kv_cache_dtype="fp8")
    rows = advise(replace(pool, flags=flags))
    assert _row(rows, "--quantization").kind == "change"
    assert _row(rows, "--quantization").advised == "fp8"
    assert _row(rows, "--tensor-parallel-size").kind != "not checked"


def test_advise_output_for_an_unquantized_pool_reads_back_as_unquantized() -> None:
    # advise prints an unquantized pool as "--quantization none"; copied into --flags, the same.
    pool = load_snapshot(Path("docs/advise/rag-pool.yaml"))["rag"]
    pool = replace(pool, flags=replace(pool.flags, kv_cache_dtype="fp8"))
    printed = _row(advise(pool), "--quantization")
    assert printed.current is None and printed.advised == "fp8"
    copied = replace(pool, flags=replace(pool.flags, quantization="none"))
    assert _row(advise(copied), "--quantization").advised == printed.advised


@pytest.mark.parametrize("interval", ["nan", "inf", "-1", "1e9"])
def test_an_interval_that_is_no_number_of_seconds_is_refused_before_any_scrape(
    interval: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The second planning review: nan and inf reached time.sleep and ended in a traceback.
    from fleetgate.cli import main

    argv = ["advise", "--engine", "http://127.0.0.1:9", "--samples", "2", "--interval", interval]
    assert main(argv) == 2
    assert "--interval a number of seconds from 0 to 3600" in capsys.readouterr().err
