"""The kernels as torch ops and as a vLLM layer, checked inside the vLLM venv (torch, Triton).

One subprocess runs ``PROBE`` and prints a JSON verdict per check; each check is a test here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.test_kernels_numerics import run_in_kernel_env

PROBE = r'''
import json, os, sys, tempfile
os.environ["TRITON_INTERPRET"] = "1"
trace_dir = tempfile.mkdtemp()
os.environ["FLEETGATE_KERNEL_TRACE_DIR"] = trace_dir
import torch
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
import replica.kernels.vllm_plugin as plugin
from replica.kernels import ops, trace
from vllm.model_executor.layers.layernorm import RMSNorm

from replica.kernels.cases import TOLERANCES
from replica.kernels.check import _compare, within_budget

out = {}
# Seeded: the normalised output may differ from vLLM's by an ulp for some inputs (the kernel's
# contract is the sweep's tolerance; about one unseeded draw in 300 of these shapes differs).
torch.manual_seed(0)

def close(a, b):
    # The sweep's own comparison (replica/kernels/check.py) at its bf16 tolerance and within its
    # bf16 mismatch budget (share of elements that differ, ulps).
    return _compare(a, b, *TOLERANCES["bfloat16"])[0] and within_budget(a, b, "bfloat16")[0]

x = torch.randn(5, 96, dtype=torch.bfloat16)
r = torch.randn(5, 96, dtype=torch.bfloat16)
w = torch.randn(96, dtype=torch.bfloat16)

# The ops exist in torch.ops and pass PyTorch's own op checks (schema, fake tensor, autograd
# registration), so torch.compile can treat them as opaque.
for op, args in ((torch.ops.fleetgate.rms_norm.default, (x, w, 1e-6)),
                 (torch.ops.fleetgate.rms_norm.default, (x, None, 1e-6)),
                 (torch.ops.fleetgate.fused_add_rms_norm.default, (x, r, w, 1e-6))):
    torch.library.opcheck(op, args)
out["ops"] = list(plugin.FLEETGATE_OPS)

trace.reset()
compiled = torch.compile(lambda a, b: ops.fused_add_rms_norm(a * 2, b, w, 1e-6),
                         backend="eager", fullgraph=True)
compiled(x, r)
compiled(x, r)
out["compiled_calls"] = trace.counts()["fused_add_rms_norm"]["calls"]

# register_oot: every RMSNorm a model builds is fleetgate's, and with the op enabled its forward
# is the Triton kernel, with vLLM's native numerics.
trace.reset()
with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["none", "+rms_norm"]))):
    layer = RMSNorm(96, eps=1e-6, dtype=torch.bfloat16)
with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["none"]))):
    disabled = RMSNorm(96, eps=1e-6, dtype=torch.bfloat16)
with torch.no_grad():
    layer.weight.copy_(w)
    got, got_res = layer(x, r)
    want, want_res = layer.forward_native(x.clone(), r.clone())
    out["layer_class"] = type(layer).__name__
    # The normalised output within the sweep's bf16 tolerance; the new residual bit for bit.
    out["layer_matches_native"] = bool(close(got, want) and torch.equal(got_res, want_res))
    out["layer_no_residual_matches"] = bool(close(layer(x), layer.forward_native(x)))
    disabled(x, r)
out["layer_counts"] = trace.counts()
out["disabled_forward"] = disabled._forward_method.__name__
with open(trace.trace_path(trace_dir)) as f:
    out["trace_file"] = json.load(f)
out["pid"] = os.getpid()
print(json.dumps(out))
'''

#: With VLLM_BATCH_INVARIANT=1, which implementation each platform forward of the layer runs:
#: vLLM's ``rms_norm_batch_invariant`` (replaced by a sentinel), the kernel (counted by
#: ``trace``) or neither (vLLM's forward_native).
BATCH_INVARIANT_PROBE = r'''
import json, os
os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_BATCH_INVARIANT"] = "1"
import torch
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
import vllm.model_executor.layers.layernorm as layernorm
import replica.kernels.vllm_plugin as plugin
from replica.kernels import trace

calls = []
def sentinel(x, weight, eps, residual=None):
    calls.append("rms_norm_batch_invariant")
    return x if residual is None else (x, residual)
layernorm.rms_norm_batch_invariant = sentinel

with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(
        custom_ops=["none", "+rms_norm"]))):
    layer = layernorm.RMSNorm(64, eps=1e-6, dtype=torch.bfloat16)
x = torch.randn(3, 64, dtype=torch.bfloat16)
r = torch.randn(3, 64, dtype=torch.bfloat16)
out = {"layer_class": type(layer).__name__}
for name in ("forward_cuda", "forward_hip", "forward_cpu"):
    calls.clear()
    trace.reset()
    forward = getattr(layer, name)
    forward(x)
    forward(x, r)
    out[name] = {"batch_invariant": len(calls), "kernel": trace.counts()}
print(json.dumps(out))
'''

NO_INTERPRETER = (
    "import os; os.environ.pop('TRITON_INTERPRET', None); "
    "import replica.kernels.vllm_plugin"
)


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    proc = run_in_kernel_env("-c", PROBE, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ops_are_registered_and_pass_opcheck(probe: dict[str, Any]) -> None:
    assert probe["ops"] == ["fleetgate::rms_norm", "fleetgate::fused_add_rms_norm"]


def test_torch_compile_keeps_the_op_opaque_and_every_call_is_counted(
    probe: dict[str, Any],
) -> None:
    assert probe["compiled_calls"] == 2  # fullgraph: no graph break around the Triton launch


def test_vllm_rms_norm_is_replaced_and_calls_the_kernel(probe: dict[str, Any]) -> None:
    assert probe["layer_class"] == "FleetgateRMSNorm"
    assert probe["layer_matches_native"] and probe["layer_no_residual_matches"]
    # One call each through the layer; the layer built with the op disabled never reaches it.
    assert probe["layer_counts"] == {"fused_add_rms_norm": {"calls": 1, "rows": 5},
                                     "rms_norm": {"calls": 1, "rows": 5}}
    assert probe["disabled_forward"] == "forward_native"


def test_trace_file_holds_this_process_counters(probe: dict[str, Any]) -> None:
    trace = probe["trace_file"]
    assert trace["pid"] == probe["pid"]
    assert trace["ops"] == probe["layer_counts"]
    assert trace["version"]


def test_batch_invariant_mode_keeps_vllms_batch_invariant_kernel() -> None:
    proc = run_in_kernel_env("-c", BATCH_INVARIANT_PROBE, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["layer_class"] == "FleetgateRMSNorm"
    # On CUDA and ROCm, vLLM's RMSNorm runs rms_norm_batch_invariant (both forms); so must ours,
    # and the Triton kernel must not run.
    for platform in ("forward_cuda", "forward_hip"):
        assert got[platform] == {"batch_invariant": 2, "kernel": {}}, (platform, got)
    # On CPU vLLM runs forward_native: neither the batch-invariant kernel nor ours.
    assert got["forward_cpu"] == {"batch_invariant": 0, "kernel": {}}, got


def test_a_cpu_engine_without_the_interpreter_refuses_the_plugin() -> None:
    # Strict mode then stops the engine: better than a replica that claims a kernel it cannot run.
    proc = run_in_kernel_env("-c", NO_INTERPRETER, timeout=300)
    assert proc.returncode != 0
    assert "KernelUnavailable" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr
