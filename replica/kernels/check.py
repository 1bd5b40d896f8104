"""Run each kernel against its reference and report the error per case.

    python -m replica.kernels.check [--full] [--json] [--device auto|cpu|cuda]  # 1: a failure

What ``fleetgate kernels check`` runs, what the CI tests parse (``--json``) and what
``bench.kernels`` starts with. Without a GPU it switches Triton to its interpreter
(``TRITON_INTERPRET=1``) before the kernel module is imported, so the same kernel source runs on
CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from replica.kernels.cases import MISMATCH_BUDGETS, Case, cases

__all__ = ["INTERPRETER_ONLY_WARNING", "CaseResult", "main", "max_ulps", "prepare_backend",
           "run_case", "run_cases", "within_budget"]


def prepare_backend(device: str = "auto") -> str:
    """Choose the device (``cuda`` if present) and, for CPU, turn on Triton's interpreter.

    Must run before ``replica.kernels.rms_norm`` is imported: ``triton.jit`` reads the switch
    when it decorates the kernel.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if "replica.kernels.rms_norm" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the kernel module was imported before TRITON_INTERPRET=1 was set")
        os.environ["TRITON_INTERPRET"] = "1"
    return device


#: What ``--device auto`` says on stderr when it finds no CUDA device: a green run then proves
#: nothing about the compiled kernel (the interpreter has missed GPU-only bugs before).
INTERPRETER_ONLY_WARNING = (
    "replica.kernels: WARNING: this torch sees no CUDA device, so --device auto runs Triton's "
    "interpreter on CPU: the compiled kernel was NOT checked. On a GPU host, gate a roll-out "
    "with --device cuda (exits 2 without CUDA)."
)


@dataclass
class CaseResult:
    """How one case went: ``ok`` iff every element is within tolerance, the mismatches stay within
    the dtype's budget (share of elements, ulps; ``cases.MISMATCH_BUDGETS``) and residuals are
    exact."""

    name: str
    ok: bool
    max_abs: float
    max_rel: float
    #: Elements whose bits differ from the reference's (NaN == NaN, 0 == -0).
    mismatches: int
    elements: int
    atol: float
    rtol: float
    #: For ``fused_add_rms_norm``: bit-differences in the new residual (must be 0).
    residual_mismatches: int
    seconds: float
    error: str = ""
    #: Largest distance, in units in the last place of the output dtype, of a finite element
    #: from the reference's (-1 when the kernel raised).
    max_ulps: int = 0
    #: How many mismatches the dtype's budget allows for this case (``Case.allowed_mismatches``).
    allowed_mismatches: int = 0
    #: The budget's limit on ``max_ulps``.
    allowed_ulps: int = 0


def _inputs(case: Case, device: str) -> tuple[Any, Any, Any]:
    import torch

    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(case.seed * 7919 + case.rows * 31 + case.hidden)
    shape = (case.rows, case.hidden)

    def values() -> torch.Tensor:
        t = torch.randn(shape, generator=gen)
        if case.values == "large":
            t *= 1e3
        elif case.values == "tiny":
            t *= 1e-4
        elif case.values == "zeros":
            t.zero_()
        elif case.values == "constant":
            t.fill_(3.0)
        elif case.values == "mixed":
            t *= torch.logspace(-3, 3, case.rows).unsqueeze(1)
        elif case.values == "subnormal":
            t *= torch.finfo(dtype).tiny * 4
        elif case.values == "nonfinite":
            t[0, case.hidden // 2] = math.inf
            t[-1, 0] = math.nan
        return t.to(dtype)

    x, residual = values(), values()
    if case.layout == "strided":  # every row a slice of a wider row (stride != hidden)
        wide = torch.zeros((case.rows, case.hidden + 64), dtype=dtype)
        wide[:, 16:16 + case.hidden] = x
        x = wide[:, 16:16 + case.hidden]
    elif case.layout == "3d":
        x, residual = x.view(3, -1, case.hidden), residual.view(3, -1, case.hidden)
    weight = None
    if case.weight == "random":
        weight = torch.randn(case.hidden, generator=gen).to(dtype)
    elif case.weight == "strided":  # a view with stride 2: the kernel must not assume 1
        weight = torch.randn(2 * case.hidden, generator=gen).to(dtype)[::2]
    elif case.weight == "ones":
        weight = torch.ones(case.hidden, dtype=dtype)
    move = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    return move(x), move(residual), None if weight is None else move(weight)


_INT_VIEW = {"float32": "int32", "bfloat16": "int16", "float16": "int16"}


def _ulps(got: Any, want: Any) -> Any:
    """Per element, how many representable values of the dtype lie between ``got`` and ``want``
    (0 == -0; meaningful for finite values only)."""
    import torch

    dtype = str(want.dtype).removeprefix("torch.")
    as_int = getattr(torch, _INT_VIEW[dtype])
    bits = torch.finfo(want.dtype).bits
    magnitude_mask = (1 << (bits - 1)) - 1

    def ordered(t: Any) -> Any:
        i = t.contiguous().view(as_int).to(torch.int64)
        magnitude = i & magnitude_mask
        return torch.where(i < 0, -magnitude, magnitude)

    return (ordered(got) - ordered(want)).abs()


def _compare(got: Any, want: Any, atol: float, rtol: float) -> tuple[bool, float, float, int]:
    import torch

    g, w = got.float(), want.float()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    same = (g == w) | (nan_g & nan_w)
    finite = torch.isfinite(w) & torch.isfinite(g)
    diff = torch.where(finite, (g - w).abs(), torch.zeros_like(g))
    # An infinite or NaN result must match exactly (``same``); finite ones within tolerance.
    within = same | (finite & (diff <= atol + rtol * w.abs()))
    nonzero = finite & (w != 0)
    rel = torch.where(nonzero, diff / w.abs().clamp_min(1e-30), torch.zeros_like(g))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float(rel.max()) if rel.numel() else 0.0
    return bool(within.all()), max_abs, max_rel, int((~same).sum())


def max_ulps(got: Any, want: Any) -> int:
    """The largest ulp distance between finite elements of ``got`` and ``want`` (same dtype)."""
    import torch

    # A reference value below the smallest normal is left to ``atol``: a GPU flushes such
    # results to zero (fp32 FTZ), thousands of subnormal ulps away but 1e-41 in value.
    normal = want.abs() >= torch.finfo(want.dtype).tiny
    counted = torch.isfinite(got) & torch.isfinite(want) & normal
    ulps = torch.where(counted, _ulps(got, want), torch.zeros_like(counted, dtype=torch.int64))
    return int(ulps.max()) if ulps.numel() else 0


def within_budget(got: Any, want: Any, dtype: str) -> tuple[bool, int, int]:
    """Whether ``got`` breaks the rounding contract less often than ``dtype``'s mismatch budget
    allows (``cases.MISMATCH_BUDGETS``): ``(ok, mismatches, max ulps)``."""
    from replica.kernels.cases import allowed_mismatches

    _, _, _, mismatches = _compare(got, want, 0.0, 0.0)
    ulps = max_ulps(got, want)
    ok = mismatches <= allowed_mismatches(dtype, got.numel())
    return ok and ulps <= MISMATCH_BUDGETS[dtype][1], mismatches, ulps


def _run_kernel(kernel: Any, case: Case, x: Any, residual: Any, weight: Any) -> tuple[Any, Any]:
    with warnings.catch_warnings():
        # inf * 0 in the non-finite case is the point of that case, not a problem to report.
        warnings.simplefilter("ignore", RuntimeWarning)
        if case.op == "rms_norm":
            return kernel.rms_norm(x, weight, case.eps), None
        return kernel.fused_add_rms_norm(x, residual, weight, case.eps)


def run_case(case: Case, device: str) -> CaseResult:
    """Build the case's inputs, run kernel and reference, compare."""
    import torch

    from replica.kernels import reference
    from replica.kernels import rms_norm as kernel

    atol, rtol = case.tolerance
    allowed, allowed_ulps = case.allowed_mismatches, case.mismatch_budget[1]
    x, residual, weight = _inputs(case, device)
    start = time.perf_counter()
    try:
        got, got_res = _run_kernel(kernel, case, x, residual, weight)
        if device != "cpu":
            torch.cuda.synchronize()
    except Exception as exc:  # a kernel that raises is a failed case, reported as such
        return CaseResult(case.name, False, math.inf, math.inf, -1, x.numel(), atol, rtol, -1,
                          time.perf_counter() - start, f"{type(exc).__name__}: {exc}", -1,
                          allowed, allowed_ulps)
    seconds = time.perf_counter() - start
    if case.op == "rms_norm":
        want, want_res = reference.rms_norm_ref(x, weight, case.eps), None
    else:
        want, want_res = reference.fused_add_rms_norm_ref(x, residual, weight, case.eps)
    ok, max_abs, max_rel, mismatches = _compare(got, want, atol, rtol)
    ulps = max_ulps(got, want) if got.dtype == want.dtype else -1
    # Within tolerance is not enough: dropping one of vLLM's roundings moves a fifth of bf16/fp16
    # outputs by 1-2 ulps, inside the per-element tolerance. The budget catches that.
    ok = ok and mismatches <= allowed and 0 <= ulps <= allowed_ulps
    res_mismatches = 0
    if want_res is not None:
        res_mismatches = _compare(got_res, want_res, 0.0, 0.0)[3]
        ok = ok and res_mismatches == 0
    ok = ok and got.shape == want.shape and got.dtype == want.dtype
    return CaseResult(case.name, ok, max_abs, max_rel, mismatches, got.numel(), atol, rtol,
                      res_mismatches, seconds, "", ulps, allowed, allowed_ulps)


def run_cases(selected: Iterable[Case], device: str,
              on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Every case in order; ``on_result`` sees each as it finishes (for live output)."""
    results = []
    for case in selected:
        result = run_case(case, device)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def format_result(r: CaseResult) -> str:
    """One line per case: status, name, max abs / rel error, bit mismatches and ulps against their
    budget, tolerance."""
    status = "ok  " if r.ok else "FAIL"
    line = (f"{status} {r.name:<52} max_abs={r.max_abs:<10.3g} max_rel={r.max_rel:<10.3g} "
            f"mismatch={r.mismatches}/{r.elements} (budget {r.allowed_mismatches}) "
            f"ulps={r.max_ulps} (budget {r.allowed_ulps}) "
            f"tol(atol={r.atol:g}, rtol={r.rtol:g}) {r.seconds:.2f}s")
    if r.residual_mismatches:
        line += f" residual_mismatch={r.residual_mismatches}"
    return line + (f"  {r.error}" if r.error else "")


def backend_name(device: str) -> str:
    """How the kernel ran: ``triton-interpreter (cpu)`` or ``triton (cuda: <device name>)``."""
    if device == "cpu":
        return "triton-interpreter (cpu)"
    import torch

    return f"triton ({device}: {torch.cuda.get_device_name()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replica.kernels.check",
                                     description="Compare each kernel with its reference.")
    parser.add_argument("--full", action="store_true",
                        help="the full sweep (realistic Llama shapes; minutes under the "
                             "interpreter) instead of the CI one")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU if torch sees one, else the interpreter on CPU, "
                             "with a warning on stderr; cuda: the compiled kernel or exit 2")
    parser.add_argument("--match", default="", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("replica.kernels: --device cuda, but this torch sees no CUDA device; use "
                  "--device cpu (Triton's interpreter) or auto", file=sys.stderr)
            return 2
    device = prepare_backend(args.device)
    if args.device == "auto" and device == "cpu":
        print(INTERPRETER_ONLY_WARNING, file=sys.stderr, flush=True)
    from replica.kernels import __version__

    selected = [c for c in cases(args.full) if args.match in c.name]
    if not selected:
        print(f"replica.kernels: no case's name contains {args.match!r}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"replica.kernels {__version__}: {len(selected)} cases on "
              f"{backend_name(device)}", flush=True)
    results = run_cases(selected, device,
                        None if args.json else lambda r: print(format_result(r), flush=True))
    failed = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps({"version": __version__, "backend": backend_name(device),
                          "results": [asdict(r) for r in results]}))
    else:
        print(f"{len(results) - len(failed)}/{len(results)} cases within tolerance"
              + (f"; FAILED: {', '.join(r.name for r in failed)}" if failed else ""))
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
