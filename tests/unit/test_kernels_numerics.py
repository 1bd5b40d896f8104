"""The Triton kernel against its PyTorch reference, run by Triton's interpreter on CPU.

Torch and Triton live in the vLLM venv only (fleetgate's venv serves the gateway, which needs
neither; docs/kernels.md says why), so the sweep runs there, once per module, as the operator's
own ``python -m replica.kernels.check --json``; each case is then one test here. A missing vLLM
venv fails these tests with the install command: it never skips.
"""

from __future__ import annotations

import json
import os
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
                      env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python *args`` in the vLLM venv, from the repository root."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([str(kernel_python()), *args], cwd=REPO_ROOT, capture_output=True,
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


def test_fleetgate_kernels_check_passes_here() -> None:
    # From fleetgate's own venv (no torch): the command runs the check in the vLLM venv.
    fleetgate = Path(sys.executable).parent / "fleetgate"
    proc = subprocess.run([str(fleetgate), "kernels", "check", "--match", "1x128"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6/6 cases within tolerance" in proc.stdout
    assert "max_abs=" in proc.stdout and "max_rel=" in proc.stdout
