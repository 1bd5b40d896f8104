"""fleetgate's own kernels, shipped to replicas as a vLLM kernel plugin (docs/kernels.md).

A self-contained package (it imports nothing else from fleetgate) so it can also be built into its
own wheel. The layout is one job per module:

* ``rms_norm`` — the Triton kernel (fused residual-add + RMSNorm) and its launcher;
* ``reference`` — the PyTorch reference each kernel is tested against;
* ``ops`` — ``torch.library`` ops around the launchers (opaque to ``torch.compile``), which count
  their calls (``trace``);
* ``vllm_plugin`` — the module operators list in ``FLEETGATE_KERNEL_PLUGINS``: it registers the
  ops and replaces vLLM's ``RMSNorm`` through ``CustomOp.register_oot``;
* ``cases`` / ``check`` — the correctness sweep run by the tests, ``fleetgate kernels check`` and
  ``python -m bench.kernels``.

Importing this package needs neither torch nor Triton (``cases`` is pure Python), so fleetgate's
own venv can list the cases; everything else needs torch and Triton.
"""

from __future__ import annotations

__all__ = ["__version__"]

#: The kernel package's version: what the replica reports and routing can require. Bump it with
#: every change to a kernel's source or launch parameters (docs/kernels.md, "Rolling out").
__version__ = "0.1.1"
