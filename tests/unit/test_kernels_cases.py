"""The kernel correctness sweep covers what the issue asks of it (pure Python: no torch here)."""

from __future__ import annotations

from replica.kernels.cases import (
    CI_CASES,
    DTYPES,
    FULL_CASES,
    MISMATCH_BUDGETS,
    MISMATCH_FLOOR,
    OPS,
    TOLERANCES,
    VALUE_KINDS,
    Case,
    allowed_mismatches,
)


def test_case_names_are_unique_and_the_full_sweep_contains_ci() -> None:
    names = [c.name for c in FULL_CASES]
    assert len(names) == len(set(names))
    assert set(CI_CASES) <= set(FULL_CASES)


def test_ci_sweep_covers_shapes_dtypes_and_edge_values() -> None:
    combos = {(c.op, c.dtype) for c in CI_CASES}
    assert combos == {(op, dtype) for op in OPS for dtype in DTYPES}
    assert any(c.rows == 1 for c in CI_CASES)                          # one row
    assert any(c.rows % 2 and c.hidden % 2 for c in CI_CASES)          # odd sizes
    assert any(c.hidden & (c.hidden - 1) for c in CI_CASES)            # hidden not a power of 2
    assert max(c.rows for c in CI_CASES) >= 2048                       # a large batch
    assert any(c.hidden == 4096 for c in CI_CASES)                     # Llama-3-8B
    assert {c.values for c in CI_CASES} == set(VALUE_KINDS)            # every edge-value kind
    assert {c.weight for c in CI_CASES} == {"random", "ones", "strided", "none"}
    assert {c.layout for c in CI_CASES} == {"contiguous", "strided", "3d"}


def test_full_sweep_has_the_benchmark_shapes() -> None:
    llama = {c.rows for c in FULL_CASES if c.hidden == 4096}
    assert {1, 16, 64, 256, 1024, 8192} <= llama
    assert {8192, 16384} <= {c.hidden for c in FULL_CASES}


def test_tolerances_are_no_looser_than_vllms_own_kernel_tests() -> None:
    # vLLM 0.32 vllm/ir/tolerances.py (and its fp16 rms_norm override): atol, rtol.
    vllm = {"float32": (1e-5, 1.3e-6), "bfloat16": (1e-3, 1.6e-2), "float16": (1e-2, 2e-3)}
    for dtype, (atol, rtol) in TOLERANCES.items():
        assert atol <= vllm[dtype][0]
        # fp32 rtol is 16 ulps (2e-6), vLLM's 1.3e-6 with a 10x looser atol: compare the sum
        # at a typical |y| of 1.
        assert atol + rtol <= sum(vllm[dtype]) * 1.0001


def test_bf16_and_fp16_have_a_mismatch_budget_far_below_a_dropped_rounding() -> None:
    # A kernel that drops one of vLLM's roundings changes 15-29 % of bf16/fp16 outputs by 1-2
    # ulps (inside the tolerance); the real kernel changes at most ~2e-4 (cases.py docstring).
    assert set(MISMATCH_BUDGETS) == set(DTYPES)
    for dtype in ("bfloat16", "float16"):
        share, ulps = MISMATCH_BUDGETS[dtype]
        assert share <= 1e-3 and ulps == 2
    assert MISMATCH_BUDGETS["float32"][1] <= 16


def test_allowed_mismatches_has_a_floor_and_scales_with_the_case() -> None:
    assert allowed_mismatches("bfloat16", 700) == MISMATCH_FLOOR
    assert allowed_mismatches("bfloat16", 1) == 1
    assert allowed_mismatches("bfloat16", 1_048_576) == 104
    assert allowed_mismatches("float32", 1000) == 1000
    assert Case("rms_norm", 256, 4096, "float16").allowed_mismatches == 1048
