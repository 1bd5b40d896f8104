"""The kernel plugin an engine loads: ``FLEETGATE_KERNEL_PLUGINS=replica.kernels.vllm_plugin``.

Importing it (fleetgate's hook does, in every engine process) registers the ``fleetgate::`` ops
and replaces vLLM's ``RMSNorm`` layer through vLLM's supported out-of-tree mechanism,
``CustomOp.register_oot``: every ``RMSNorm(...)`` a model builds afterwards is a
``FleetgateRMSNorm``, whose platform forwards call the Triton kernel.

Two vLLM rules decide whether the kernel runs, and both are kept rather than overridden:

* vLLM's own switch for the op, ``--compilation-config '{"custom_ops": ["+rms_norm"]}'``
  (or ``-rms_norm``): the class keeps the in-tree name ``rms_norm`` for it. Whenever vLLM's
  compile backend is Inductor — the default on GPUs, and on CPU even when LoRA then makes the
  model run eagerly — custom ops default to off and vLLM's native code runs instead; the layer
  then logs once that the kernel is not in use. So deploy with ``+rms_norm``.
* ``VLLM_BATCH_INVARIANT=1`` keeps vLLM's batch-invariant implementation: the layer then runs
  what vLLM's ``RMSNorm`` runs on that platform (on a GPU its ``forward_cuda``, which calls
  ``rms_norm_batch_invariant``), never the Triton kernel.

On a CPU-only engine Triton has no backend: the import fails (strict mode then refuses to start)
unless ``TRITON_INTERPRET=1`` runs the kernel through Triton's interpreter, which is slow and meant
for validation (the e2e test does exactly that).
"""

from __future__ import annotations

import torch
from vllm import envs
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.platforms import current_platform

from replica.kernels import __version__, ops
from replica.kernels.rms_norm import KernelUnavailable, interpreting

__all__ = ["FLEETGATE_OPS", "FleetgateRMSNorm", "__version__"]

#: Ops the kernel-plugin hook verifies in ``torch.ops`` after importing this module.
FLEETGATE_OPS = ops.OPS

logger = init_logger(__name__)

if current_platform.is_cpu() and not interpreting():
    raise KernelUnavailable(
        "replica.kernels needs a GPU for its Triton kernels; this engine is CPU-only. Set "
        "TRITON_INTERPRET=1 to run them through Triton's interpreter (slow: validation only), "
        "or do not list replica.kernels.vllm_plugin on CPU replicas"
    )


@CustomOp.register_oot(name="RMSNorm")
class FleetgateRMSNorm(RMSNorm):
    """vLLM's ``RMSNorm`` with the forward replaced by fleetgate's fused Triton kernel."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # A disabled custom op dispatches to forward_native (vLLM's code), never to ours.
        if getattr(self._forward_method, "__func__", None) is RMSNorm.forward_native:
            _warn_disabled_once()

    def _triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.variance_size_override is not None:
            # Variance over a prefix of the row: vLLM's own code (what its forward_cuda runs).
            return super().forward_native(x, residual)
        if residual is None:
            weight = self.weight.data if self.pass_weight else None
            return ops.rms_norm(x, weight, self.variance_epsilon)
        weight = self.weight.data if self.pass_weight_add else None
        return ops.fused_add_rms_norm(x, residual, weight, self.variance_epsilon)

    # The dispatch targets of an enabled CustomOp on the platforms Triton serves (and on CPU,
    # where only the interpreter gets here). ``forward_native`` stays vLLM's: it is what runs
    # when the op is disabled, and the reference the kernel is held to.
    #
    # With ``VLLM_BATCH_INVARIANT=1`` each one runs exactly what vLLM's RMSNorm runs on that
    # platform: on CUDA and ROCm its forward_cuda, i.e. ``rms_norm_batch_invariant`` (not
    # forward_native, whose ``ir.ops`` dispatch picks the non-invariant ``torch.ops._C`` kernel);
    # on CPU CustomOp's forward_cpu, which is forward_native.
    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if envs.VLLM_BATCH_INVARIANT:
            return RMSNorm.forward_cuda(self, x, residual)
        return self._triton(x, residual)

    def forward_hip(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if envs.VLLM_BATCH_INVARIANT:
            return RMSNorm.forward_cuda(self, x, residual)  # vLLM's forward_hip is forward_cuda
        return self._triton(x, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if envs.VLLM_BATCH_INVARIANT:
            return RMSNorm.forward_cpu(self, x, residual)
        return self._triton(x, residual)


# register_oot named the class after the registry key; give it back the in-tree op name so
# vLLM's custom_ops switch ("+rms_norm" / "-rms_norm") governs it as it governs RMSNorm.
FleetgateRMSNorm.name = "rms_norm"

_warned = False


def _warn_disabled_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "fleetgate kernels %s: vLLM has the rms_norm custom op disabled (its default whenever "
            "the compile backend is Inductor), so RMSNorm layers run vLLM's native code, not the "
            "Triton kernel. Enable it with --compilation-config '{\"custom_ops\": "
            "[\"+rms_norm\"]}'.",
            __version__,
        )
