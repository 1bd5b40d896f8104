"""The Triton kernel against its PyTorch reference, run by Triton's interpreter on CPU.

Torch and Triton live in the vLLM venv only (fleetgate's venv serves the gateway, which needs
neither; docs/kernels.md says why), so the sweep runs there, once per module, as the operator's
own ``python -m replica.kernels.check --json``; each case is then one test here. A missing vLLM
venv fails these tests with the install command: it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replica.kernels import __version__
from replica.kernels.cases import CI_CASES, Case
from replica.vllm_env import INSTALL_COMMAND, REPO_ROOT, venv_python

#: The CI sweep takes ~20 s under the interpreter on 2 cores (imports included).
SWEEP_TIMEOUT_S = 600


def kernel_python() -> Path:
    """The interpreter with torch and Triton (the vLLM venv's); FAIL if there is none."""
    python = venv_python()
    if not python.exists():
        pytest.fail(f"kernel tests need the vLLM venv (torch, triton): {INSTALL_COMMAND}",
                    pytrace=False)
    return python


def run_in_kernel_env(*args: str, timeout: float = SWEEP_TIMEOUT_S,
                      env: dict[str, str] | None = None,
                      cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """``python *args`` in the vLLM venv, from the repository root (or ``cwd``)."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([str(kernel_python()), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, check=False, env={**base, **(env or {})})


@pytest.fixture(scope="module")
def sweep() -> dict[str, Any]:
    proc = run_in_kernel_env("-m", "replica.kernels.check", "--json")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(sweep: dict[str, Any], case: Case) -> None:
    results = {r["name"]: r for r in sweep["results"]}
    result = results[case.name]
    assert not result["error"], result["error"]
    assert result["ok"], result
    assert result["residual_mismatches"] == 0, result  # x + residual is rounded once: exact


def test_sweep_ran_the_kernel_through_the_interpreter(sweep: dict[str, Any]) -> None:
    assert sweep["backend"] == "triton-interpreter (cpu)"
    assert sweep["version"] == __version__
    assert [r["name"] for r in sweep["results"]] == [c.name for c in CI_CASES]


def test_check_exits_1_and_names_the_case_when_a_kernel_is_wrong() -> None:
    # An operator's pre-rollout check must fail loudly: break the kernel, keep the reference.
    broken = (
        "import sys, replica.kernels.check as c; c.prepare_backend('cpu'); "
        "import replica.kernels.rms_norm as k; k.rms_norm = lambda x, w, eps: x * 1.01; "
        "sys.exit(c.main(['--match', 'rms_norm-fp32-7x100']))"
    )
    proc = run_in_kernel_env("-c", broken, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL rms_norm-fp32-7x100" in proc.stdout
    # (--match also picks fused_add_rms_norm-fp32-7x100, whose kernel is intact.)
    assert "1/2 cases within tolerance; FAILED: rms_norm-fp32-7x100" in proc.stdout


#: Kernels that break the rounding contract of ``reference.py`` (docs/kernels.md, "Numerics")
#: while staying within the per-element tolerance: (what is broken, source to replace, with,
#: a case it shows in).
_MUTANTS = {
    "no-rounding-before-weight-multiply": (
        "        y = _to_f32(_from_f32(y, W.dtype.element_ty)) * _to_f32(w)\n"
        "        y = _to_f32(_from_f32(y, W.dtype.element_ty))\n",
        "        y = y * _to_f32(w)\n",
        "rms_norm-bf16-256x4096",
    ),
    "variance-of-the-rounded-residual-sum": (
        "                 _from_f32(x, R_OUT.dtype.element_ty), mask=mask)\n",
        "                 _from_f32(x, R_OUT.dtype.element_ty), mask=mask)\n"
        "        x = _to_f32(_from_f32(x, R_OUT.dtype.element_ty))\n",
        "fused_add_rms_norm-bf16-256x4096",
    ),
}


@pytest.mark.parametrize("mutant", sorted(_MUTANTS))
def test_check_exits_1_and_names_the_case_when_a_kernel_drops_a_rounding(
    mutant: str, tmp_path: Path,
) -> None:
    # Both mutants move 1-2 ulps, inside the tolerance, in ~20 % of the bf16 elements; only the
    # mismatch budget (cases.MISMATCH_BUDGETS) tells them from the real kernel.
    old, new, case = _MUTANTS[mutant]
    shutil.copytree(REPO_ROOT / "replica", tmp_path / "replica",
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "replica" / "kernels" / "rms_norm.py"
    text = source.read_text()
    assert text.count(old) == 1, f"the kernel source changed: update the {mutant} mutant"
    source.write_text(text.replace(old, new))
    proc = run_in_kernel_env("-m", "replica.kernels.check", "--device", "cpu", "--match", case,
                             timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAIL {case} " in proc.stdout
    # (--match also picks the fused_add_ case of the same shape: both ops may fail.)
    summary = proc.stdout.strip().splitlines()[-1]
    assert "cases within tolerance; FAILED: " in summary
    assert case in summary.split("FAILED: ")[1].split(", ")


def test_fleetgate_kernels_check_passes_here() -> None:
    # From fleetgate's own venv (no torch): the command runs the check in the vLLM venv.
    fleetgate = Path(sys.executable).parent / "fleetgate"
    proc = subprocess.run([str(fleetgate), "kernels", "check", "--match", "1x128"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the compiled kernel was NOT checked" in proc.stderr  # no GPU here: interpreter
    assert "6/6 cases within tolerance" in proc.stdout
    assert "max_abs=" in proc.stdout and "max_rel=" in proc.stdout


def test_auto_device_without_cuda_warns_that_the_compiled_kernel_was_not_checked() -> None:
    # --device auto on a host whose torch sees no GPU falls back to the interpreter: a green
    # result must not read as a check of the compiled kernel. --device cpu is asked for: no
    # warning; --device cuda refuses to fall back.
    env = {"CUDA_VISIBLE_DEVICES": ""}
    auto = run_in_kernel_env("-m", "replica.kernels.check", "--match", "fp32-1x128",
                             timeout=300, env=env)
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert "the compiled kernel was NOT checked" in auto.stderr
    assert "--device cuda" in auto.stderr
    cpu = run_in_kernel_env("-m", "replica.kernels.check", "--match", "fp32-1x128",
                            "--device", "cpu", timeout=300, env=env)
    assert cpu.returncode == 0 and "NOT checked" not in cpu.stderr, cpu.stdout + cpu.stderr
    cuda = run_in_kernel_env("-m", "replica.kernels.check", "--match", "fp32-1x128",
                             "--device", "cuda", timeout=300, env=env)
    assert cuda.returncode == 2, cuda.stdout + cuda.stderr


#: fp32 bit patterns for the bf16 rounding: NaNs as a GPU makes them (0x7FFFFFFF: the canonical
#: NaN of NVIDIA's fp32 arithmetic; found on an H200, where NaN + NaN came out as -0.0) and as
#: x86 does, infinities, the largest finite (rounds to inf), ties to even, a subnormal.
_ROUNDING_BITS = (0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00001, 0x7F800000, 0xFF800000,
                  0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x00012345, 0x80000000, 0)
_ROUNDING_SCRIPT = """
import sys, torch, triton, triton.language as tl
from replica.kernels.rms_norm import _from_f32

@triton.jit
def down(x_ptr, y_ptr, n: tl.constexpr):
    offs = tl.arange(0, n)
    tl.store(y_ptr + offs, _from_f32(tl.load(x_ptr + offs), tl.bfloat16))

bits = [int(b) for b in sys.argv[1:]]
n = triton.next_power_of_2(len(bits))
x = torch.tensor(bits + [0] * (n - len(bits)), dtype=torch.int64).to(torch.int32)
x = x.view(torch.float32)
y = torch.empty(n, dtype=torch.bfloat16)
down[(1,)](x, y, n)
for got, want in zip(y[:len(bits)], x[:len(bits)].to(torch.bfloat16)):
    same = got.view(torch.int16) == want.view(torch.int16) or (got.isnan() and want.isnan())
    print(hex(got.view(torch.int16).item() & 0xFFFF), hex(want.view(torch.int16).item() & 0xFFFF),
          "ok" if same else "WRONG")
"""


def test_bf16_rounding_matches_torch_on_edge_bit_patterns() -> None:
    # The interpreter's own NaNs never carry into the sign bit, so the sweep cannot see this.
    args = [str(b - (1 << 32) if b >= 1 << 31 else b) for b in _ROUNDING_BITS]
    proc = run_in_kernel_env("-c", _ROUNDING_SCRIPT, *args, timeout=300,
                             env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split("\n")[: len(_ROUNDING_BITS)]
    assert [line.endswith(" ok") for line in lines] == [True] * len(_ROUNDING_BITS), proc.stdout
