"""A minimal kernel plugin, used by the vLLM plugin's tests: what an operator's plugin looks like.

Importing it registers ``fleetgate_test::scale(Tensor x, float factor) -> Tensor`` with PyTorch's
dispatcher through ``torch.library`` (a real op, callable as ``torch.ops.fleetgate_test.scale``),
and declares it in ``FLEETGATE_OPS`` so fleetgate's hook checks that the op really exists in each
engine process. A production plugin would register a fused kernel, or replace a vLLM layer with
``CustomOp.register_oot``, the same way: at import time.
"""

from __future__ import annotations

import torch

__all__ = ["FLEETGATE_OPS", "__version__", "scale"]

__version__ = "0.3.1"

#: Ops this plugin registers (checked by fleetgate's kernel-plugin hook after the import).
FLEETGATE_OPS = ("fleetgate_test::scale",)

# Held at module level: the registrations live as long as this Library object does.
_LIBRARY = torch.library.Library("fleetgate_test", "DEF")
_LIBRARY.define("scale(Tensor x, float factor) -> Tensor")


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """The op's implementation (any device): ``x * factor`` as a new tensor."""
    return x * factor


_LIBRARY.impl("scale", scale, "CompositeExplicitAutograd")
