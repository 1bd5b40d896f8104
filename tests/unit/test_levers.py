"""The roofline lever table: figures recomputed from the formulas, fits flags, the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from planning.levers import LeverParams, add_arguments, lever_table, run

# The seed scenario, restated: 8B on one H100-class GPU. GB are decimal (1e9 bytes).
PARAMS, LAYERS, KV_HEADS, HEAD_DIM = 8.03e9, 32, 8, 128
HBM_GB, BW, EFF = 80, 3.35e12, 0.7
BF16_FLOPS, FP8_FLOPS, MFU, PRICE = 989e12, 1979e12, 0.4, 3.00
PROMPT, SHARED, OUTPUT = 6000, 5000, 300
BYTES = {"bf16": 2, "fp8": 1, "int4": 0.5}
AVERAGE_CONTEXT = PROMPT + OUTPUT / 2  # 6,150 tokens: sizes both the KV held and the KV read

SCENARIOS = [
    "bf16 weights + bf16 KV",
    "FP8 weights (W8A8)",
    "+ FP8 KV",
    "+ prefix cache (5k shared)",
    "+ batch 128",
    "bf16 at batch 128",
    "INT4 (W4A16) + FP8 KV + cache, batch 32",
]


def kv_per_token(kv_dtype: str) -> float:
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES[kv_dtype]


def tpot_s(weight_dtype: str, kv_dtype: str, batch: int) -> float:
    context = batch * AVERAGE_CONTEXT
    return (PARAMS * BYTES[weight_dtype] + context * kv_per_token(kv_dtype)) / (BW * EFF)


@pytest.fixture(scope="module")
def rows() -> dict[str, object]:
    return {row.scenario: row for row in lever_table()}


def test_seven_scenarios_in_order(rows: dict) -> None:
    assert list(rows) == SCENARIOS


# Every figure of every reference row, worked out by hand.
#
# Shared quantities:
#   KV bytes/token  = 2 (K, V) × 32 layers × 8 KV heads × 128 head dim × dtype bytes
#                   = 131,072 B in bf16, 65,536 B in fp8
#   average context = 6,000 + 300 / 2 = 6,150 tokens per sequence
#   KV held         = batch × 6,150 tokens; with the prefix cache the 5,000 shared tokens are
#                     stored once: 5,000 + batch × (6,150 − 5,000) = 5,000 + batch × 1,150
#   KV read / step  = batch × 6,150 tokens (shared blocks are still read by every sequence)
#   effective HBM   = 3.35e12 B/s × 0.7 = 2.345e12 B/s
#   fits            = weights + KV held <= 0.9 × 80 GB = 72 GB
#   prefill FLOPS   = 989e12 × 0.4 = 3.956e14 (bf16, also W4A16) or 1979e12 × 0.4 = 7.916e14 (W8A8)
#   prefill FLOPs   = 2 × 8.03e9 × 6,000 = 9.636e13, or 2 × 8.03e9 × 1,000 = 1.606e13 with the
#                     prefix cache (only the 1,000 unshared tokens; the prefix is already cached)
#   tokens/s        = batch / TPOT;  $/1M = 3.00 / 3600 / (tokens/s) × 1e6
#
# (1) bf16 + bf16 KV, batch 32
#   weights 8.03e9 × 2 = 16.06 GB;  KV 32 × 6,150 × 131,072 = 25.7949696 GB;  16.06 + 25.79 <= 72
#   TTFT 9.636e13 / 3.956e14 = 243.5794 ms
#   TPOT (16.06e9 + 25.7949696e9) / 2.345e12 = 17.84860 ms;  32 / 0.0178486 = 1,792.858 tok/s
#   $ 3 / 3600 / 1792.858 × 1e6 = 0.4648073
# (2) FP8 weights (W8A8), bf16 KV, batch 32
#   weights 8.03 GB;  KV 25.7949696 GB (unchanged);  8.03 + 25.79 <= 72
#   TTFT 9.636e13 / 7.916e14 = 121.7281 ms
#   TPOT (8.03e9 + 25.7949696e9) / 2.345e12 = 14.42429 ms;  32 / 0.01442429 = 2,218.479 tok/s
#   $ 3 / 3600 / 2218.479 × 1e6 = 0.3756327
# (3) + FP8 KV, batch 32
#   weights 8.03 GB;  KV 32 × 6,150 × 65,536 = 12.8974848 GB;  8.03 + 12.90 <= 72
#   TTFT 121.7281 ms (as row 2)
#   TPOT (8.03e9 + 12.8974848e9) / 2.345e12 = 8.924301 ms;  32 / 0.008924301 = 3,585.715 tok/s
#   $ 3 / 3600 / 3585.715 × 1e6 = 0.2324037
# (4) + prefix cache, batch 32
#   weights 8.03 GB;  KV (5,000 + 32 × 1,150) × 65,536 = 41,800 × 65,536 = 2.7394048 GB
#   TTFT 1.606e13 / 7.916e14 = 20.28802 ms
#   TPOT, tokens/s, $: as row 3 (every sequence still reads all 6,150 tokens)
# (5) + batch 128
#   weights 8.03 GB;  KV (5,000 + 128 × 1,150) × 65,536 = 152,200 × 65,536 = 9.9745792 GB
#   TTFT 20.28802 ms (as row 4)
#   TPOT (8.03e9 + 128 × 6,150 × 65,536) / 2.345e12 = (8.03e9 + 51.5899392e9) / 2.345e12
#        = 25.42428 ms;  128 / 0.02542428 = 5,034.557 tok/s
#   $ 3 / 3600 / 5034.557 × 1e6 = 0.1655227
# (6) bf16 + bf16 KV, batch 128
#   weights 16.06 GB;  KV 128 × 6,150 × 131,072 = 103.1798784 GB;  16.06 + 103.18 > 72: NO
#   TTFT 243.5794 ms (as row 1)
#   TPOT (16.06e9 + 103.1798784e9) / 2.345e12 = 50.84856 ms;  128 / 0.05084856 = 2,517.279 tok/s
#   $ 3 / 3600 / 2517.279 × 1e6 = 0.3310453
# (7) INT4 weights (W4A16) + FP8 KV + prefix cache, batch 32
#   weights 8.03e9 × 0.5 = 4.015 GB;  KV 2.7394048 GB (as row 4);  4.015 + 2.74 <= 72
#   TTFT 1.606e13 / 3.956e14 = 40.59656 ms (W4A16 computes in 16-bit: bf16 FLOPS)
#   TPOT (4.015e9 + 12.8974848e9) / 2.345e12 = 7.212147 ms;  32 / 0.007212147 = 4,436.959 tok/s
#   $ 3 / 3600 / 4436.959 × 1e6 = 0.1878163
REFERENCE_ROWS = [
    # batch, weights GB, KV GB,    fits,  TTFT ms,  TPOT ms,  tok/s,    $/1M out
    (32, 16.06, 25.7949696, True, 243.5794, 17.84860, 1792.858, 0.4648073),
    (32, 8.03, 25.7949696, True, 121.7281, 14.42429, 2218.479, 0.3756327),
    (32, 8.03, 12.8974848, True, 121.7281, 8.924301, 3585.715, 0.2324037),
    (32, 8.03, 2.7394048, True, 20.28802, 8.924301, 3585.715, 0.2324037),
    (128, 8.03, 9.9745792, True, 20.28802, 25.42428, 5034.557, 0.1655227),
    (128, 16.06, 103.1798784, False, 243.5794, 50.84856, 2517.279, 0.3310453),
    (32, 4.015, 2.7394048, True, 40.59656, 7.212147, 4436.959, 0.1878163),
]


@pytest.mark.parametrize(
    ("scenario", "expected"), list(zip(SCENARIOS, REFERENCE_ROWS, strict=True))
)
def test_row_pins_the_reference_figures(rows: dict, scenario: str, expected: tuple) -> None:
    batch, weight_gb, kv_gb, fits, ttft_ms, tpot_ms, tokens_per_s, usd = expected
    row = rows[scenario]
    assert row.batch == batch
    assert row.weight_gb == pytest.approx(weight_gb)
    assert row.kv_gb == pytest.approx(kv_gb)
    assert row.fits is fits
    # The hand figures above are rounded to 7 significant digits.
    assert row.ttft_ms == pytest.approx(ttft_ms, rel=1e-6)
    assert row.tpot_ms == pytest.approx(tpot_ms, rel=1e-6)
    assert row.tokens_per_s == pytest.approx(tokens_per_s, rel=1e-6)
    assert row.usd_per_m_output_tokens == pytest.approx(usd, rel=1e-6)


@pytest.mark.parametrize(
    ("scenario", "weight_dtype", "kv_dtype", "batch", "cached", "flops"),
    [
        ("bf16 weights + bf16 KV", "bf16", "bf16", 32, False, BF16_FLOPS),
        ("FP8 weights (W8A8)", "fp8", "bf16", 32, False, FP8_FLOPS),
        ("+ FP8 KV", "fp8", "fp8", 32, False, FP8_FLOPS),
        ("+ prefix cache (5k shared)", "fp8", "fp8", 32, True, FP8_FLOPS),
        ("+ batch 128", "fp8", "fp8", 128, True, FP8_FLOPS),
        ("bf16 at batch 128", "bf16", "bf16", 128, False, BF16_FLOPS),
        # W4A16 computes in 16-bit: bf16 FLOPS even though the weights are 4-bit.
        ("INT4 (W4A16) + FP8 KV + cache, batch 32", "int4", "fp8", 32, True, BF16_FLOPS),
    ],
)
def test_row_matches_the_formulas(
    rows: dict,
    scenario: str,
    weight_dtype: str,
    kv_dtype: str,
    batch: int,
    cached: bool,
    flops: float,
) -> None:
    row = rows[scenario]
    tpot = tpot_s(weight_dtype, kv_dtype, batch)
    # Held at the same average context the reads use; shared blocks stored once when cached.
    held = SHARED + batch * (AVERAGE_CONTEXT - SHARED) if cached else batch * AVERAGE_CONTEXT
    prefilled = PROMPT - SHARED if cached else PROMPT
    assert row.batch == batch
    assert row.weight_gb == pytest.approx(PARAMS * BYTES[weight_dtype] / 1e9)
    assert row.kv_gb == pytest.approx(held * kv_per_token(kv_dtype) / 1e9)
    assert row.fits is (row.weight_gb + row.kv_gb <= 0.9 * HBM_GB)
    assert row.tpot_ms == pytest.approx(tpot * 1000)
    assert row.ttft_ms == pytest.approx(2 * PARAMS * prefilled / (flops * MFU) * 1000)
    assert row.tokens_per_s == pytest.approx(batch / tpot)
    assert row.usd_per_m_output_tokens == pytest.approx(PRICE / 3600 / (batch / tpot) * 1e6)


def test_cli_prints_the_reference_table(capsys: pytest.CaptureFixture) -> None:
    # The REFERENCE_ROWS above, as the table rounds them.
    assert run(parse([])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [" ".join(line.split()) for line in lines[2:]] == [
        "bf16 weights + bf16 KV 16.1 25.8 yes 243.6 17.85 1793 0.465",
        "FP8 weights (W8A8) 8.0 25.8 yes 121.7 14.42 2218 0.376",
        "+ FP8 KV 8.0 12.9 yes 121.7 8.92 3586 0.232",
        "+ prefix cache (5k shared) 8.0 2.7 yes 20.3 8.92 3586 0.232",
        "+ batch 128 8.0 10.0 yes 20.3 25.42 5035 0.166",
        "bf16 at batch 128 16.1 103.2 NO 243.6 50.85 2517 0.331",
        "INT4 (W4A16) + FP8 KV + cache, batch 32 4.0 2.7 yes 40.6 7.21 4437 0.188",
    ]


def test_a_smaller_gpu_stops_fitting() -> None:
    rows = lever_table(LeverParams(hbm_gb=24))
    assert [r.fits for r in rows] == [False, False, True, True, True, False, True]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"shared_prefix_tokens": 7000}, "shared_prefix_tokens"),
        ({"mfu": 1.5}, "mfu"),
        ({"batch": 0}, "batch"),
        ({"large_batch": 16}, "large_batch"),  # the batch lever grows the batch
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


@pytest.mark.parametrize("field", ["shared_prefix_tokens", "output_tokens"])
def test_zero_shared_prefix_or_output_is_a_valid_workload(field: str) -> None:
    params = LeverParams(**{field: 0})
    table = lever_table(params)
    for row in table:
        for value in (row.kv_gb, row.ttft_ms, row.tpot_ms, row.tokens_per_s):
            assert value >= 0 and value == value and value != float("inf")
        assert 0 < row.usd_per_m_output_tokens < float("inf")
    if field == "shared_prefix_tokens":
        # No shared prefix: the prefix-cache row is the row without the cache.
        fp8_kv, cached = table[2], table[3]
        assert cached.scenario == "+ prefix cache (none shared)"
        assert (cached.kv_gb, cached.ttft_ms, cached.tpot_ms) == (
            fp8_kv.kv_gb,
            fp8_kv.ttft_ms,
            fp8_kv.tpot_ms,
        )


@pytest.mark.parametrize("field", ["prompt_tokens", "batch", "hbm_gb"])
def test_zero_is_still_refused_elsewhere(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}: must be a finite number > 0"):
        LeverParams(**{field: 0})


def test_cli_accepts_zero_shared_tokens(capsys: pytest.CaptureFixture) -> None:
    assert run(parse(["--shared-tokens", "0", "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["params"]["shared_prefix_tokens"] == 0


def test_params_file_reads_exponent_numbers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    params_file = tmp_path / "p.yaml"
    params_file.write_text("model_params: 70.6e9\nlayers: 80\nhbm_gb: 1.41e2\n")
    assert run(parse(["--params", str(params_file), "--json"])) == 0
    params = json.loads(capsys.readouterr().out)["params"]
    assert (params["model_params"], params["hbm_gb"]) == (70.6e9, 141)


@pytest.mark.parametrize(
    ("name", "message"),
    [("x.foo", "format 'foo' is not supported"), ("missing/x.png", "no such folder")],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_bad_plot_path_fails_before_printing(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str, message: str, as_json: bool
) -> None:
    argv = ["--plot", str(tmp_path / name)] + (["--json"] if as_json else [])
    assert run(parse(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1


def test_cli_reports_every_problem_of_a_params_file_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    params_file = tmp_path / "bad.yaml"
    params_file.write_text("prompt_token: 5\nbogus: 1\nbatch: 0\nmfu: 2\n")
    assert run(parse(["--params", str(params_file)])) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4, err
    assert err[0].endswith("bogus: unknown parameter")
    assert err[1].endswith("prompt_token: unknown parameter (did you mean 'prompt_tokens'?)")
    assert {line.split("error: ", 1)[1] for line in err[2:]} == {
        "batch: must be a finite number > 0 (got 0)",
        "mfu: must be in (0, 1] (got 2)",
    }

    params_file.write_text("batch: 0\nshared_prefix_tokens: 9000\n")  # with another problem
    assert run(parse(["--params", str(params_file)])) == 2
    assert "shared_prefix_tokens (9000) must be <= prompt_tokens" in capsys.readouterr().err
