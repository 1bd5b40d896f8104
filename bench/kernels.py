"""Benchmark fleetgate's kernels against vLLM's own implementations; write the results.

    python -m bench.kernels                     # in the engine's environment (torch, Triton, vLLM)
    .venv-vllm/bin/python -m bench.kernels      # here: the vLLM CPU venv

1. The correctness sweep (``replica.kernels.check``, the full one by default): every case's max
   abs / rel error against the PyTorch reference. On CPU this is all it does, through Triton's
   interpreter, and the report says that no timings were taken.
2. On a GPU, timings (``triton.testing.do_bench``, median) of each kernel, both the bare launcher
   (``replica.kernels.rms_norm``) and the ``torch.ops.fleetgate`` op the engine's layer calls
   (``torch.library`` dispatch and the call counter on top), against vLLM's CUDA
   kernels (``torch.ops._C.rms_norm`` / ``fused_add_rms_norm``, what ``RMSNorm`` runs on a GPU
   without the plugin when its custom op is on) and against vLLM's native PyTorch code (what it
   runs when the custom op is off), over Llama-3-8B shapes: hidden 4096, bf16, 1 to 8192 tokens.

The report goes to ``docs/benchmarks/kernels.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from replica.kernels.cases import TOLERANCES, cases

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "benchmarks" / "kernels.md"
#: Llama-3-8B: hidden 4096; decode batches of 1-256 tokens, prefill chunks up to 8k.
HIDDEN = 4096
TOKENS = (1, 16, 64, 256, 1024, 8192)
EPS = 1e-5


@dataclass
class Timing:
    op: str
    tokens: int
    ours_us: float
    vllm_cuda_us: float | None
    vllm_native_us: float
    #: Bytes the op must move (inputs read once, outputs written once).
    bytes_moved: int
    #: The native code under ``torch.compile`` (Inductor fuses it into one generated kernel,
    #: which is what vLLM runs with the custom op off and compilation on); None if not timed.
    compiled_us: float | None = None
    #: Our kernel through ``torch.ops.fleetgate`` (what ``FleetgateRMSNorm`` calls: custom-op
    #: dispatch plus ``trace.record``); ``ours_us`` is the bare launcher. None if not timed.
    ours_op_us: float | None = None

    @property
    def ours_gbps(self) -> float:
        return self.bytes_moved / (self.ours_us * 1e-6) / 1e9


def _time_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


#: What the "native" column is when vLLM is not installed (a bare GPU host): the PyTorch
#: reference, which follows vLLM 0.32's native code operation for operation.
NATIVE_WITHOUT_VLLM = "replica.kernels.reference"


class Baselines(NamedTuple):
    """What our kernels are timed against."""

    #: vLLM's CUDA ops (``torch.ops._C``); None where vLLM is not installed.
    cuda_rms: Callable[..., Any] | None
    cuda_fused: Callable[..., Any] | None
    #: vLLM's native PyTorch code, or ``replica.kernels.reference`` without vLLM.
    native_rms: Callable[..., Any]
    native_fused: Callable[..., Any]
    #: What the native column is: ``"vllm"`` or ``NATIVE_WITHOUT_VLLM``.
    native: str


def _baselines() -> Baselines:
    """vLLM's CUDA ops and native code; without vLLM, no CUDA ops and the reference as native."""
    import torch

    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        from vllm.ir.ops.layernorm import fused_add_rms_norm as vllm_fused
        from vllm.ir.ops.layernorm import rms_norm as vllm_rms
    except ImportError:
        from replica.kernels import reference

        return Baselines(None, None, reference.rms_norm_ref, reference.fused_add_rms_norm_ref,
                         NATIVE_WITHOUT_VLLM)
    return Baselines(torch.ops._C.rms_norm, torch.ops._C.fused_add_rms_norm,
                     vllm_rms.impls["native"].impl_fn, vllm_fused.impls["native"].impl_fn, "vllm")


def gpu_timings() -> tuple[list[Timing], str]:
    """Our kernels vs vLLM's CUDA kernels and native code, bf16, hidden 4096; and what the
    native column is (``"vllm"``, or ``NATIVE_WITHOUT_VLLM`` where vLLM is not installed)."""
    import torch

    import replica.kernels.ops  # noqa: F401  (registers torch.ops.fleetgate)
    from replica.kernels import rms_norm as ours

    # What the engine's layer calls (FleetgateRMSNorm._triton -> ops -> torch.ops.fleetgate).
    op_rms = torch.ops.fleetgate.rms_norm.default
    op_fused = torch.ops.fleetgate.fused_add_rms_norm.default
    cuda_rms, cuda_fused, native_rms, native_fused, native = _baselines()
    # One compiled graph per shape (dynamic=False), as a served model's fixed batch sizes get.
    compiled_rms = torch.compile(native_rms, dynamic=False)
    compiled_fused = torch.compile(native_fused, dynamic=False)
    out: list[Timing] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=gen)
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, dtype=torch.bfloat16, device="cuda", generator=gen)
        y = torch.empty_like(x)
        elem = x.numel() * x.element_size()
        out.append(Timing(
            "rms_norm", tokens,
            _time_ms(lambda x=x, w=w: ours.rms_norm(x, w, EPS)) * 1e3,
            None if cuda_rms is None
            else _time_ms(lambda x=x, w=w, y=y: cuda_rms(y, x, w, EPS)) * 1e3,
            _time_ms(lambda x=x, w=w: native_rms(x, w, EPS)) * 1e3,
            2 * elem + w.numel() * 2,
            _time_ms(lambda x=x, w=w: compiled_rms(x, w, EPS)) * 1e3,
            _time_ms(lambda x=x, w=w: op_rms(x, w, EPS)) * 1e3,
        ))
        # vLLM's fused kernel works in place; the drift of repeated calls stays finite in bf16.
        xi, ri = x.clone(), r.clone()
        out.append(Timing(
            "fused_add_rms_norm", tokens,
            _time_ms(lambda x=x, r=r, w=w: ours.fused_add_rms_norm(x, r, w, EPS)) * 1e3,
            None if cuda_fused is None
            else _time_ms(lambda xi=xi, ri=ri, w=w: cuda_fused(xi, ri, w, EPS)) * 1e3,
            _time_ms(lambda x=x, r=r, w=w: native_fused(x, r, w, EPS)) * 1e3,
            4 * elem + w.numel() * 2,
            _time_ms(lambda x=x, r=r, w=w: compiled_fused(x, r, w, EPS)) * 1e3,
            _time_ms(lambda x=x, r=r, w=w: op_fused(x, r, w, EPS)) * 1e3,
        ))
    return out, native


def _versions() -> dict[str, str]:
    import importlib

    from replica.kernels import __version__

    found = {"replica.kernels": __version__}
    for name in ("torch", "triton", "vllm"):
        try:
            found[name] = importlib.import_module(name).__version__
        except ImportError:
            found[name] = "not installed"
    found["python"] = platform.python_version()
    return found


def render(device: str, backend: str, results: list[Any], timings: list[Timing] | None,
           full: bool, seconds: float, native: str = "vllm") -> str:
    """The markdown report."""
    versions = _versions()
    ok = sum(r.ok for r in results)
    lines = [
        "# Kernel benchmark: fleetgate's Triton kernels vs vLLM",
        "",
        f"Written by `python -m bench.kernels` on {datetime.date.today().isoformat()}, "
        f"{platform.machine()}, {backend}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "See docs/kernels.md for the kernels, the tolerances and how to roll one out.",
        "",
        "## Timings",
        "",
    ]
    if timings is None:
        lines += [
            "**No GPU on this machine: no timings were taken.** Triton has no CPU backend; on CPU "
            "the kernels run through Triton's interpreter (numpy, one Python loop iteration per "
            "program), whose speed says nothing about the compiled kernel. Run the same command "
            "on a GPU host (`python -m bench.kernels` in the engine image) to fill this section "
            "with our kernels against vLLM's CUDA kernels and native PyTorch code, bf16, hidden "
            f"{HIDDEN} (Llama-3-8B), {', '.join(map(str, TOKENS))} tokens.",
        ]
    else:
        if native == "vllm":
            about = ("*vLLM CUDA* is `torch.ops._C` (what vLLM's RMSNorm runs on a GPU with its "
                     "custom op on), *vLLM native* the PyTorch code it runs with the op off "
                     "(eager).")
        else:
            about = ("**vLLM is not installed on this host**, so there is no *vLLM CUDA* column "
                     f"and *vLLM native* is `{native}`, the PyTorch reference the kernels are "
                     "checked against, which follows vLLM 0.32's native code operation for "
                     "operation (eager, uncompiled), in place of vLLM's own.")
        lines += [
            f"Median of `triton.testing.do_bench`, bf16, hidden {HIDDEN}, eps {EPS:g}. {about} "
            "*Native compiled* is the same native code under `torch.compile` (one graph per "
            "shape): Inductor fuses it into one generated kernel, which is what vLLM runs with "
            "the custom op off and compilation on. *Ours launcher* times the bare launcher "
            "(`replica.kernels.rms_norm`); *ours op* the `torch.ops.fleetgate` op that vLLM's "
            "layer calls (`torch.library` dispatch and the call counter on top), which is what "
            "an eager step pays. The ratios are baseline time / our launcher's time: **above 1x "
            "ours is faster**, below 1x slower. GB/s is our launcher's effective bandwidth "
            "(inputs read once, outputs written once).",
            "",
            "| op | tokens | ours launcher µs | ours op µs | vLLM CUDA µs | vLLM native µs "
            "| native compiled µs | CUDA / ours (>1x: ours faster) "
            "| compiled / ours (>1x: ours faster) | ours GB/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for t in timings:
            ratio = f"{t.vllm_cuda_us / t.ours_us:.2f}x" if t.vllm_cuda_us else "-"
            cuda = f"{t.vllm_cuda_us:.1f}" if t.vllm_cuda_us else "-"
            compiled = f"{t.compiled_us:.1f}" if t.compiled_us else "-"
            vs_compiled = f"{t.compiled_us / t.ours_us:.2f}x" if t.compiled_us else "-"
            op = f"{t.ours_op_us:.1f}" if t.ours_op_us else "-"
            lines.append(f"| {t.op} | {t.tokens} | {t.ours_us:.1f} | {op} | {cuda} | "
                         f"{t.vllm_native_us:.1f} | {compiled} | {ratio} | {vs_compiled} | "
                         f"{t.ours_gbps:.0f} |")
    lines += [
        "",
        f"## Correctness ({'full' if full else 'CI'} sweep, {device})",
        "",
        f"{ok}/{len(results)} cases within tolerance ({seconds:.0f} s). Tolerance per element: "
        "`|kernel - reference| <= atol + rtol * |reference|` with "
        + "; ".join(f"{d} atol {a:g} rtol {r:g}" for d, (a, r) in TOLERANCES.items())
        + " (justified in `replica/kernels/cases.py`). *mismatch*: elements whose bits differ "
        "from the reference's; the new residual of the fused op must match bit for bit.",
        "",
        "| case | ok | max abs err | max rel err | mismatch | residual mismatch |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r.name} | {'yes' if r.ok else '**NO**'} | {r.max_abs:.3g} | "
                     f"{r.max_rel:.3g} | {r.mismatches}/{r.elements} | {r.residual_mismatches} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", choices=("full", "ci"), default="full",
                        help="correctness sweep to run first (full: minutes on CPU)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    from replica.kernels.check import backend_name, format_result, prepare_backend, run_cases

    device = prepare_backend("auto")
    backend = backend_name(device)
    full = args.sweep == "full"
    selected = cases(full)
    print(f"correctness: {len(selected)} cases on {backend}", flush=True)
    started = datetime.datetime.now()
    results = run_cases(selected, device, lambda r: print(format_result(r), flush=True))
    seconds = (datetime.datetime.now() - started).total_seconds()
    timings, native = None, "vllm"
    if device == "cuda":
        print("timings: ours vs vLLM", flush=True)
        timings, native = gpu_timings()
    else:
        print("no GPU: correctness sweep only (the interpreter's speed means nothing)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(device, backend, results, timings, full, seconds, native))
    print(f"written to {args.out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
