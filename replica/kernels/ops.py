"""The kernels as ``torch.library`` ops: ``torch.ops.fleetgate.rms_norm`` and
``torch.ops.fleetgate.fused_add_rms_norm``.

Why ops rather than plain functions: ``torch.compile`` (vLLM compiles the model by default)
treats a registered op as opaque, using the fake implementation for shapes, instead of tracing
into the Triton launcher; and the ops are visible in ``torch.ops``, where the kernel-plugin hook
checks that they exist (``FLEETGATE_OPS``). Every call is counted (``trace``).

No ``from __future__ import annotations`` here: ``custom_op`` reads the real annotations to
build the op's schema.
"""

import torch

from replica.kernels import rms_norm as kernel
from replica.kernels import trace

__all__ = ["OPS", "fused_add_rms_norm", "rms_norm"]

#: The ops this module registers (``namespace::name``), as the kernel-plugin hook checks them.
OPS = ("fleetgate::rms_norm", "fleetgate::fused_add_rms_norm")


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


@torch.library.custom_op("fleetgate::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (Triton)."""
    trace.record("rms_norm", _rows(x))
    return kernel.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fleetgate::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass (Triton); inputs untouched."""
    trace.record("fused_add_rms_norm", _rows(x))
    return kernel.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _fused_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)
