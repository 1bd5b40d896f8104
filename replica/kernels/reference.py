"""PyTorch references for the kernels: the numerics a kernel must reproduce.

They follow vLLM 0.32's own native implementations (``vllm/ir/ops/layernorm.py``) operation for
operation, casts included, because that is what an engine without the plugin computes: the
residual sum is formed in fp32 and rounded once to the activation dtype, the variance comes from
the unrounded fp32 sum, and the normalised value is rounded to the weight's dtype *before* the
weight multiply. A kernel that skipped that intermediate rounding would be "more accurate" and
yet disagree with every replica that does not run it.
"""

from __future__ import annotations

import torch

__all__ = ["fused_add_rms_norm_ref", "rms_norm_ref"]


def _normalise(x32: torch.Tensor, weight: torch.Tensor | None, eps: float,
               out_dtype: torch.dtype) -> torch.Tensor:
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    y = x32 * torch.rsqrt(variance + eps)
    if weight is not None:
        y = y.to(weight.dtype) * weight
    return y.to(out_dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x²) + eps)`` over the last dimension."""
    return _normalise(x.to(torch.float32), weight, eps, x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the normalised sum and the new residual."""
    summed = x.to(torch.float32) + residual.to(torch.float32)
    return _normalise(summed, weight, eps, x.dtype), summed.to(x.dtype)
