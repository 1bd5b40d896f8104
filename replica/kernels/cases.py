"""The correctness sweep: which inputs each kernel is checked on, and how close is close enough.

Pure Python (no torch), so fleetgate's own venv can list and parametrise the cases; ``check``
builds the tensors and runs them.

Tolerances (``|kernel - reference| <= atol + rtol * |reference|`` per element)
----------------------------------------------------------------------------
The kernel performs the reference's operations in the same order with the same roundings
(``reference.py``), so it differs only where fp32 arithmetic is not associative: the order in
which the row's squares are summed (Triton's tree reduction against PyTorch's vectorised one)
and ``1/sqrt`` against ``rsqrt``. Both are a few fp32 ulps of the inverse RMS (pairwise
summation error grows with log2(hidden) <= 16 ulps). That perturbs the fp32 normalised value by
~1e-6 relative, which can only change a result that is then rounded to bf16/fp16 when it sits
next to a rounding boundary, and then by one ulp of the weight dtype; the weight multiply and
final rounding can carry that to two ulps. Hence:

* fp32: ``rtol = 2e-6`` (16 ulps of 2^-23), ``atol = 1e-6`` — tighter than vLLM's 1e-5 default.
* bf16: ``rtol = 1.6e-2`` (two ulps, 2 x 2^-7) — vLLM's own bf16 default; ``atol = 1e-3``.
* fp16: ``rtol = 2e-3`` (two ulps, 2 x 2^-10); ``atol = 1e-3``, ten times tighter than vLLM's
  rms_norm fp16 override (``atol = 1e-2, rtol = 2e-3``).

The new residual (``x + residual`` rounded once) involves no reduction: it must be bit-exact.

Mismatch budget (``MISMATCH_BUDGETS``): how *often* an output may differ, and by how many ulps
---------------------------------------------------------------------------------------------
The per-element tolerance is two ulps wide, and dropping one of the reference's roundings (no
rounding to the weight dtype before the multiply, or the variance of the rounded residual sum)
moves outputs by only one or two ulps: every such kernel is within tolerance. What gives it away
is how many outputs move: 8-29 % of a case's bf16/fp16 elements (about 20 % typically), where
the real kernel differs only where an fp32 summation-order difference meets a rounding boundary.
Measured rates of the real kernel (share of elements that differ from the reference):

* bf16: at most 1.5e-5 under the interpreter (CI sweep), 6.9e-6 compiled on an H200 (full sweep,
  docs/benchmarks/kernels.md); always at most 2 ulps. Budget: 1e-4 of the elements, 2 ulps.
* fp16: at most 2e-4 under the interpreter (3 of 15,360 elements), 9.2e-5 compiled; at most 2
  ulps. Budget: 1e-3 of the elements, 2 ulps.
* fp32: 10-40 % of the elements differ (the summation order perturbs nearly every result), by at
  most 6 ulps under the interpreter. Budget: any share, 16 ulps (the summation bound above); the
  rounding contract has nothing to drop in fp32 (the weight is fp32 too).

Every case may have ``MISMATCH_FLOOR`` mismatches whatever its size, so one unlucky element in a
700-element case is not read as a rate of 1.4e-3. Ulps are counted where the reference is a
normal number; results below the smallest normal are left to ``atol`` (a GPU flushes fp32
subnormal results to zero).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CI_CASES", "FULL_CASES", "MISMATCH_BUDGETS", "MISMATCH_FLOOR", "OPS", "TOLERANCES",
           "Case", "allowed_mismatches", "cases"]

OPS = ("rms_norm", "fused_add_rms_norm")
DTYPES = ("float32", "bfloat16", "float16")

#: dtype -> (atol, rtol), justified in the module docstring.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-6, 2e-6),
    "bfloat16": (1e-3, 1.6e-2),
    "float16": (1e-3, 2e-3),
}

#: dtype -> (share of a case's elements that may differ from the reference at all, largest ulp
#: distance of a finite difference), justified in the module docstring. Gated with the
#: tolerance: a kernel that drops one of the reference's roundings stays within tolerance but
#: moves a fifth of all bf16/fp16 outputs.
MISMATCH_BUDGETS: dict[str, tuple[float, int]] = {
    "float32": (1.0, 16),
    "bfloat16": (1e-4, 2),
    "float16": (1e-3, 2),
}
#: Mismatches any case may have whatever its size, so that one unlucky element in a small case
#: is not read as a share of a percent.
MISMATCH_FLOOR = 2


def allowed_mismatches(dtype: str, elements: int) -> int:
    """How many of ``elements`` outputs may differ from the reference (``MISMATCH_BUDGETS``)."""
    share = MISMATCH_BUDGETS[dtype][0]
    return min(elements, max(MISMATCH_FLOOR, int(share * elements)))


#: What the values of ``x`` (and the residual) look like.
VALUE_KINDS = {
    "normal": "standard normal",
    "large": "normal x 1e3 (squares near fp16's range, summed in fp32)",
    "tiny": "normal x 1e-4 (mean square far below eps: eps dominates)",
    "zeros": "all zeros (output must be exactly 0, not NaN)",
    "constant": "every element 3.0 (exact RMS)",
    "mixed": "rows scaled from 1e-3 to 1e3 (no cross-row leakage in a packed tile)",
    "subnormal": "values around the dtype's smallest normal, some subnormal",
    "nonfinite": "an inf row and a NaN row among finite ones (NaN where the reference is)",
}


@dataclass(frozen=True)
class Case:
    """One kernel call to compare with its reference."""

    op: str
    rows: int
    hidden: int
    dtype: str
    values: str = "normal"
    #: ``random`` (normal), ``ones``, ``strided`` (random, every other element of a wider buffer:
    #: a weight that is not contiguous) or ``none`` (the weightless RMSNorm).
    weight: str = "random"
    eps: float = 1e-6
    #: ``contiguous``, ``strided`` (rows of a wider buffer) or ``3d`` (batch, seq, hidden).
    layout: str = "contiguous"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS or self.dtype not in DTYPES or self.values not in VALUE_KINDS:
            raise ValueError(f"bad case {self}")
        if self.weight not in ("random", "ones", "strided", "none"):
            raise ValueError(f"bad weight kind {self.weight!r}")
        if self.layout not in ("contiguous", "strided", "3d"):
            raise ValueError(f"bad layout {self.layout!r}")

    @property
    def name(self) -> str:
        extras = [e for e in (
            self.values if self.values != "normal" else "",
            f"w={self.weight}" if self.weight != "random" else "",
            f"eps={self.eps:g}" if self.eps != 1e-6 else "",
            self.layout if self.layout != "contiguous" else "",
        ) if e]
        return "-".join([self.op, _short(self.dtype), f"{self.rows}x{self.hidden}", *extras])

    @property
    def tolerance(self) -> tuple[float, float]:
        return TOLERANCES[self.dtype]

    @property
    def mismatch_budget(self) -> tuple[float, int]:
        return MISMATCH_BUDGETS[self.dtype]

    @property
    def elements(self) -> int:
        return self.rows * self.hidden

    @property
    def allowed_mismatches(self) -> int:
        return allowed_mismatches(self.dtype, self.elements)


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]


def _grid(shapes: list[tuple[int, int]]) -> list[Case]:
    return [Case(op, rows, hidden, dtype) for rows, hidden in shapes for dtype in DTYPES
            for op in OPS]


def _edges() -> list[Case]:
    out = []
    for dtype in DTYPES:
        for values in ("large", "tiny", "zeros", "mixed", "subnormal", "nonfinite"):
            out.append(Case("fused_add_rms_norm", 9, 96, dtype, values=values))
    out += [
        Case("rms_norm", 4, 128, "bfloat16", values="constant", weight="ones"),
        Case("rms_norm", 5, 200, "float32", weight="none"),
        Case("fused_add_rms_norm", 5, 200, "bfloat16", weight="none"),
        Case("fused_add_rms_norm", 6, 128, "float16", eps=1e-5),
        Case("fused_add_rms_norm", 6, 4096, "bfloat16", layout="strided"),
        Case("rms_norm", 6, 4096, "bfloat16", layout="strided"),
        Case("rms_norm", 8, 256, "bfloat16", weight="strided"),
        Case("fused_add_rms_norm", 5, 200, "float16", weight="strided"),
        Case("fused_add_rms_norm", 12, 80, "float32", layout="3d"),
    ]
    return out


#: What CI runs under the interpreter (about a minute on two cores): one row; odd row counts and
#: hidden sizes that are not powers of two (padded, masked lanes); the tiny model's 128 and
#: Llama-3-8B's 4096; a large batch of a small hidden (many rows packed per tile); edge values.
CI_CASES: tuple[Case, ...] = tuple(
    _grid([(1, 128), (7, 100), (3, 5120), (33, 4096), (256, 4096), (2048, 128), (999, 333)])
    + _edges()
)

#: ``fleetgate kernels check --full`` and the benchmark: add Llama-3-8B's decode and prefill
#: batches (1-256 tokens, 8k), 70B's hidden 8192 and 405B's 16384.
FULL_CASES: tuple[Case, ...] = CI_CASES + tuple(
    _grid([(n, 4096) for n in (1, 16, 64, 1024, 8192)] + [(64, 8192), (17, 16384)])
)


def cases(full: bool = False) -> tuple[Case, ...]:
    """The CI sweep, or the full one."""
    return FULL_CASES if full else CI_CASES
