"""``bench.kernels``' report: what its timing table says when vLLM is or is not installed."""

from __future__ import annotations

from bench.kernels import NATIVE_WITHOUT_VLLM, Timing, render


def _timing(cuda_us: float | None, compiled_us: float | None = None,
            op_us: float | None = None) -> Timing:
    return Timing("rms_norm", 16, ours_us=4.0, vllm_cuda_us=cuda_us, vllm_native_us=20.0,
                  bytes_moved=4_000_000, compiled_us=compiled_us, ours_op_us=op_us)


def test_without_vllm_the_table_says_what_native_is_and_has_no_cuda_ratio() -> None:
    page = render("cuda", "triton (cuda)", [], [_timing(None)], True, 1.0, NATIVE_WITHOUT_VLLM)
    assert "vLLM is not installed on this host" in page
    assert f"`{NATIVE_WITHOUT_VLLM}`" in page
    assert "| rms_norm | 16 | 4.0 | - | - | 20.0 | - | - | - | 1000 |" in page


def test_with_vllm_the_ratio_is_cuda_over_ours() -> None:
    page = render("cuda", "triton (cuda)", [], [_timing(6.0, compiled_us=5.0, op_us=9.0)], True,
                  1.0)
    assert "vLLM is not installed" not in page
    assert "| rms_norm | 16 | 4.0 | 9.0 | 6.0 | 20.0 | 5.0 | 1.50x | 1.25x | 1000 |" in page


def test_the_table_times_the_engines_op_and_says_which_way_the_ratios_go() -> None:
    page = render("cuda", "triton (cuda)", [], [_timing(2.0, compiled_us=3.0, op_us=41.0)],
                  True, 1.0)
    header = next(line for line in page.splitlines() if line.startswith("| op |"))
    assert "| ours launcher µs | ours op µs |" in header
    assert "CUDA / ours (>1x: ours faster)" in header
    assert "compiled / ours (>1x: ours faster)" in header
    assert "`torch.ops.fleetgate`" in page
    # The op is slower than the launcher, and the ratios stay baseline / launcher.
    assert "| rms_norm | 16 | 4.0 | 41.0 | 2.0 | 20.0 | 3.0 | 0.50x | 0.75x | 1000 |" in page


def test_without_a_gpu_no_timings_are_claimed() -> None:
    page = render("cpu", "triton-interpreter (cpu)", [], None, False, 1.0)
    assert "No GPU on this machine: no timings were taken." in page
