"""Fused residual-add + RMSNorm in Triton: one read of ``x`` (and ``residual``), one write of each
output, instead of vLLM's native path of separate add, cast, square-mean, multiply passes.

What a fleet serving Llama-class models spends time on: every decoder layer runs two of these
(``input_layernorm``, ``post_attention_layernorm``), on the critical path of every decode step,
and it is purely memory-bound, so fusing the residual add into it saves one round trip of the
hidden state through memory per call.

Numerics follow ``reference.py`` (vLLM's native implementation) cast for cast. Two details:

* bf16 <-> fp32 conversions are done on the bits. The compiled kernel would round correctly with
  a plain ``.to()``, but Triton's interpreter (how the kernel runs, and is tested, on CPU) rounds
  fp32 -> bf16 towards zero and flushes bf16 subnormals; doing it by hand makes both paths
  round-to-nearest-even and keeps subnormals, so the code tested on CPU is the code shipped.
* Each program normalises a ``BLOCK_M x BLOCK_N`` tile of rows. On a GPU, ``BLOCK_M`` is 1 for
  hidden sizes >= 2048 (one row per program, as vLLM's CUDA kernel does); small hidden sizes pack
  rows so a program still moves a useful amount of data. Under the interpreter, where every
  program is a Python-level loop iteration, tiles are made large.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "MAX_HIDDEN_SIZE",
    "KernelUnavailable",
    "fused_add_rms_norm",
    "interpreting",
    "launch_config",
    "rms_norm",
]

#: One row must fit one tile (``BLOCK_N = next_power_of_2(hidden)``); larger rows would need a
#: two-pass kernel. 65,536 covers every production hidden size (Llama-3-405B: 16,384).
MAX_HIDDEN_SIZE = 65_536
#: Elements per tile: compiled (keeps a tile in registers) and interpreted (amortises Python).
_TILE_ELEMENTS_GPU = 4096
_TILE_ELEMENTS_INTERPRETED = 1 << 16
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelUnavailable(RuntimeError):
    """The kernel cannot run on this tensor's device (or for this input): the message says why."""


@triton.jit
def _to_f32(x):
    if x.dtype == tl.bfloat16:
        # bf16 is the top half of an fp32: shifting the bits back is exact (subnormals too).
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _from_f32(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, keep the top half.
        # Not for NaN: a GPU's NaN is 0x7FFFFFFF, which that carry turns into -0.0 (0x8000);
        # NaN becomes 0x7FC0, as in PyTorch's own conversion.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, rounded)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rms_norm_kernel(
    X, R, W, Y, R_OUT,
    stride_x, stride_r, stride_y, stride_r_out,
    n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # no i32 overflow
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x = _to_f32(tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0))
    if HAS_RESIDUAL:
        x += _to_f32(tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0))
        tl.store(R_OUT + rows[:, None] * stride_r_out + cols[None, :],
                 _from_f32(x, R_OUT.dtype.element_ty), mask=mask)
    # Masked lanes are 0, so they add nothing to the sum; divide by the true width.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0)
        # vLLM rounds to the weight's dtype before the multiply; the product of two values of
        # that dtype is exact in fp32, so rounding it once more equals the dtype's own multiply.
        y = _to_f32(_from_f32(y, W.dtype.element_ty)) * _to_f32(w)
        y = _to_f32(_from_f32(y, W.dtype.element_ty))
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], _from_f32(y, Y.dtype.element_ty),
             mask=mask)


def interpreting() -> bool:
    """True if Triton kernels run through the interpreter here (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_rms_norm_kernel, InterpretedFunction)


def launch_config(n_rows: int, n_cols: int, interpreted: bool) -> dict[str, int]:
    """``BLOCK_M``, ``BLOCK_N`` and ``num_warps`` for a ``n_rows x n_cols`` input."""
    block_n = triton.next_power_of_2(n_cols)
    tile = _TILE_ELEMENTS_INTERPRETED if interpreted else _TILE_ELEMENTS_GPU
    # Powers of two only, so the compiled kernel has few variants to cache.
    block_m = max(1, min(triton.next_power_of_2(n_rows), tile // block_n))
    num_warps = max(1, min(8, block_m * block_n // 512))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps}


def _check(x: torch.Tensor, weight: torch.Tensor | None) -> None:
    if x.dtype not in _DTYPES:
        raise KernelUnavailable(f"unsupported dtype {x.dtype} (supported: {_DTYPES})")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise KernelUnavailable(f"need a non-empty last dimension (got shape {tuple(x.shape)})")
    if x.shape[-1] > MAX_HIDDEN_SIZE:
        raise KernelUnavailable(f"hidden size {x.shape[-1]} > {MAX_HIDDEN_SIZE}")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        raise KernelUnavailable(
            f"weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}"
        )
    if x.device.type == "cpu" and not interpreting():
        # Triton has no CPU backend: on CPU the kernel only runs through the interpreter.
        raise KernelUnavailable(
            "Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1 (before Triton is "
            "imported) to run them through Triton's interpreter, for validation only"
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D (rows, hidden) tensor with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x, weight)
    if weight is not None:
        # The kernel reads the weight as ``W + cols`` (unit stride); a view such as ``w[::2]``
        # would otherwise be read as garbage. Free when it is already contiguous.
        weight = weight.contiguous()
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    r2 = r_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise KernelUnavailable(
                f"residual {tuple(residual.shape)}/{residual.dtype} does not match x "
                f"{tuple(x.shape)}/{x.dtype}"
            )
        r2 = _rows(residual)
        r_out = torch.empty_like(y)
    if n_rows:
        config = launch_config(n_rows, n_cols, interpreting())
        # Unused pointers get a real tensor (the kernel never dereferences them: constexpr off).
        _rms_norm_kernel[(triton.cdiv(n_rows, config["BLOCK_M"]),)](
            x2, x2 if r2 is None else r2, x2 if weight is None else weight, y,
            y if r_out is None else r_out,
            x2.stride(0), 0 if r2 is None else r2.stride(0), y.stride(0),
            0 if r_out is None else r_out.stride(0),
            n_rows, n_cols, float(eps),
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], num_warps=config["num_warps"],
        )
    out = y.view(x.shape)
    return out, None if r_out is None else r_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; a new tensor shaped and typed like ``x``."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; both new tensors."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
