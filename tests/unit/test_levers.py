"""The roofline lever table: figures recomputed from the formulas, fits flags, the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from planning.levers import LeverParams, add_arguments, lever_table, run

# The seed scenario, restated: 8B on one H100-class GPU.
PARAMS, LAYERS, KV_HEADS, HEAD_DIM = 8.03e9, 32, 8, 128
HBM_GB, BW, EFF = 80, 3.35e12, 0.7
BF16_FLOPS, FP8_FLOPS, MFU, PRICE = 989e12, 1979e12, 0.4, 3.00
PROMPT, SHARED, OUTPUT = 6000, 5000, 300
BYTES = {"bf16": 2, "fp8": 1, "int4": 0.5}


def kv_per_token(kv_dtype: str) -> float:
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES[kv_dtype]


def tpot_s(weight_dtype: str, kv_dtype: str, batch: int) -> float:
    context = batch * (PROMPT + OUTPUT / 2)
    return (PARAMS * BYTES[weight_dtype] + context * kv_per_token(kv_dtype)) / (BW * EFF)


@pytest.fixture(scope="module")
def rows() -> dict[str, object]:
    return {row.scenario: row for row in lever_table()}


def test_seven_scenarios_in_order(rows: dict) -> None:
    assert list(rows) == [
        "bf16 weights + bf16 KV",
        "FP8 weights (W8A8)",
        "+ FP8 KV",
        "+ prefix cache (5k shared)",
        "+ batch 128",
        "bf16 at batch 128",
        "INT4 weights (W4A16) + FP8 KV + cache",
    ]


@pytest.mark.parametrize(
    ("scenario", "weight_dtype", "kv_dtype", "batch", "prefilled", "flops"),
    [
        ("bf16 weights + bf16 KV", "bf16", "bf16", 32, PROMPT, BF16_FLOPS),
        ("FP8 weights (W8A8)", "fp8", "bf16", 32, PROMPT, FP8_FLOPS),
        ("+ FP8 KV", "fp8", "fp8", 32, PROMPT, FP8_FLOPS),
        ("+ prefix cache (5k shared)", "fp8", "fp8", 32, PROMPT - SHARED, FP8_FLOPS),
        ("+ batch 128", "fp8", "fp8", 128, PROMPT - SHARED, FP8_FLOPS),
        ("bf16 at batch 128", "bf16", "bf16", 128, PROMPT, BF16_FLOPS),
        # W4A16 computes in 16-bit: bf16 FLOPS even though the weights are 4-bit.
        ("INT4 weights (W4A16) + FP8 KV + cache", "int4", "fp8", 128, PROMPT - SHARED, BF16_FLOPS),
    ],
)
def test_row_matches_the_formulas(
    rows: dict,
    scenario: str,
    weight_dtype: str,
    kv_dtype: str,
    batch: int,
    prefilled: int,
    flops: float,
) -> None:
    row = rows[scenario]
    tpot = tpot_s(weight_dtype, kv_dtype, batch)
    assert row.batch == batch
    assert row.weight_gb == pytest.approx(PARAMS * BYTES[weight_dtype] / 1e9)
    assert row.tpot_ms == pytest.approx(tpot * 1000)
    assert row.ttft_ms == pytest.approx(2 * PARAMS * prefilled / (flops * MFU) * 1000)
    assert row.tokens_per_s == pytest.approx(batch / tpot)
    assert row.usd_per_m_output_tokens == pytest.approx(PRICE / 3600 / (batch / tpot) * 1e6)


def test_bf16_batch_32_tpot_by_hand(rows: dict) -> None:
    # (16.06 GB weights + 32 × 6150 tokens × 128 KiB) / (3.35 TB/s × 0.7) ≈ 17.85 ms
    expected_ms = (16.06e9 + 32 * 6150 * 131072) / 2.345e12 * 1000
    assert rows["bf16 weights + bf16 KV"].tpot_ms == pytest.approx(expected_ms)


@pytest.mark.parametrize(
    ("scenario", "kv_dtype", "batch", "cached", "fits"),
    [
        ("bf16 weights + bf16 KV", "bf16", 32, False, True),
        ("+ prefix cache (5k shared)", "fp8", 32, True, True),
        ("+ batch 128", "fp8", 128, True, True),
        ("bf16 at batch 128", "bf16", 128, False, False),
    ],
)
def test_kv_held_and_fits(
    rows: dict, scenario: str, kv_dtype: str, batch: int, cached: bool, fits: bool
) -> None:
    row = rows[scenario]
    tokens = SHARED + batch * (PROMPT - SHARED + OUTPUT) if cached else batch * (PROMPT + OUTPUT)
    assert row.kv_gb == pytest.approx(tokens * kv_per_token(kv_dtype) / 1e9)
    assert row.fits is fits
    assert (row.weight_gb + row.kv_gb <= 0.9 * HBM_GB) is fits


def test_a_smaller_gpu_stops_fitting() -> None:
    rows = lever_table(LeverParams(hbm_gb=24))
    assert [r.fits for r in rows] == [False, False, True, True, True, False, True]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"shared_prefix_tokens": 7000}, "shared_prefix_tokens"),
        ({"mfu": 1.5}, "mfu"),
        ({"batch": 0}, "batch"),
    ],
)
def test_bad_params_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LeverParams(**overrides)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_json_applies_file_then_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    params_file = tmp_path / "scenario.yaml"
    params_file.write_text("batch: 16\noutput_tokens: 500\nhardware: h200\n")
    assert run(parse(["--params", str(params_file), "--batch", "8", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"]["batch"] == 8  # the flag beats the file
    assert data["params"]["output_tokens"] == 500
    assert data["params"]["hbm_gb"] == 141  # from the h200 profile
    assert len(data["rows"]) == 7
    assert data["rows"][0]["batch"] == 8


def test_cli_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plot = tmp_path / "levers.png"
    assert run(parse(["--plot", str(plot)])) == 0
    out = capsys.readouterr().out
    assert "bf16 at batch 128" in out and " NO " in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [("bogus: 1\n", "bogus: unknown parameter"), ("- 1\n", "expected a mapping")],
)
def test_cli_rejects_bad_params_file(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: str, message: str
) -> None:
    params_file = tmp_path / "bad.yaml"
    params_file.write_text(content)
    assert run(parse(["--params", str(params_file)])) == 2
    assert message in capsys.readouterr().err
