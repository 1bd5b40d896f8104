"""Sizing arithmetic shared by the rules: KV bytes, blocks, what fits in HBM at which TP.

The figures come from ``replica/sim/roofline.py`` (the same functions the simulated engine and
``fleetgate plan levers`` use), so ``advise``, ``simulate`` and the lever table agree:
KV bytes per token = 2 × layers × KV heads × head dim × dtype bytes, and
blocks = (HBM × TP × gpu_memory_utilization − weights) / (block_size × KV bytes per token).
Activations and CUDA graphs are ignored, so absolute block counts run a little high; the rules use
ratios (2× for FP8 KV) and the engine's own ``num_gpu_blocks`` wherever it reports one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planning.advise.model import AdviceError, EngineFlags, PoolSnapshot
from replica.sim.profiles import HardwareProfile, ModelProfile, load_hardware, load_model
from replica.sim.roofline import Roofline

#: vLLM ``--kv-cache-dtype`` values -> the roofline's dtype. ``auto`` is the model's (16-bit).
_KV_DTYPES = {
    "auto": "bf16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}
#: vLLM ``--quantization`` values -> weight dtype (None, ``none``, ``bf16``, ``fp16``, ``auto``:
#: unquantized 16-bit, sized as bf16: the same 2 bytes a weight). The roofline knows
#: bf16, fp8 and int4 (0.5 bytes a weight, scales ignored); 4-bit float formats (MXFP4, NVFP4)
#: weigh the same, so they size as ``int4``.
_WEIGHT_DTYPES = {
    None: "bf16",
    # Unquantized 16-bit weights, as people (and advise itself: "--quantization none") write it.
    "none": "bf16",
    "auto": "bf16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "bf16",
    "float16": "bf16",
    "half": "bf16",
    "fp8": "fp8",
    "fbgemm_fp8": "fp8",
    "ptpc_fp8": "fp8",
    "modelopt": "fp8",
    "compressed-tensors": "fp8",
    "awq": "int4",
    "awq_marlin": "int4",
    "gptq": "int4",
    "gptq_marlin": "int4",
    # 2:4 sparse 4-bit: fewer bytes than dense int4, so sizing it as int4 errs on the safe side.
    "gptq_marlin_24": "int4",
    "marlin": "int4",
    "qqq": "int4",
    "moe_wna16": "int4",
    "int4": "int4",
    # vLLM's in-flight bitsandbytes quantization is 4-bit (NF4).
    "bitsandbytes": "int4",
    "mxfp4": "int4",
    "modelopt_fp4": "int4",
    "petit_nvfp4": "int4",
}
#: Quantized, but how many bits a weight takes is in the checkpoint, not the method's name
#: (GGUF Q2..Q8, HQQ, AQLM 2-bit, INT8 kernels the roofline has no dtype for).
QUANTIZED_WIDTH_UNKNOWN = frozenset(
    {
        "gguf",
        "hqq",
        "aqlm",
        "bitblas",
        "gptq_bitblas",
        "quark",
        "torchao",
        "auto-round",
        "inc",
        "rtn",
        "deepspeedfp",
        "experts_int8",
        "tpu_int8",
    }
)
#: ``weight_dtype_of`` for a method whose weight width is not known here.
UNKNOWN_DTYPE = "unknown"


def kv_dtype_of(cache_dtype: str | None) -> str:
    """The roofline dtype of a vLLM ``--kv-cache-dtype`` (unknown values read as 16-bit)."""
    return _KV_DTYPES.get((cache_dtype or "auto").lower(), "bf16")


def weight_dtype_of(quantization: str | None) -> str:
    """The roofline weight dtype of a vLLM ``--quantization`` value; ``unknown`` when the method
    is not one whose width is known (the sizing rules then say "not checked")."""
    return _WEIGHT_DTYPES.get(quantization.lower() if quantization else None, UNKNOWN_DTYPE)


def flags_with_defaults(pool: PoolSnapshot) -> EngineFlags:
    """The pool's flags with vLLM's defaults filled in for its GPU (batch limits vary by GPU)."""
    memory = None
    if pool.hardware:
        try:
            memory = load_hardware(pool.hardware).memory_gb
        except (ValueError, KeyError) as exc:
            raise AdviceError(f"pool {pool.pool}: {exc}") from exc
    return pool.flags.with_defaults(pool.hardware, memory)


def blocks_for(tokens: float, block_size: int) -> int:
    """KV blocks one sequence of ``tokens`` holds (a partial block is a whole block)."""
    return max(1, math.ceil(tokens / block_size))


def round_up(tokens: float, multiple: int) -> int:
    """``tokens`` rounded up to a multiple of ``multiple``."""
    return max(multiple, math.ceil(tokens / multiple) * multiple)


@dataclass(frozen=True)
class Sizing:
    """One pool's hardware and model, for the rules that need memory arithmetic."""

    hardware: HardwareProfile
    model: ModelProfile

    @classmethod
    def of(cls, hardware: str | None, model: str | None) -> Sizing | None:
        """Profiles by name; ``None`` when either is unknown (the rules then say so)."""
        if not hardware or not model:
            return None
        return cls(load_hardware(hardware), load_model(model))

    @property
    def fp8_capable(self) -> bool:
        """True when the GPU has FP8 tensor cores (Hopper, Ada and newer)."""
        return self.hardware.fp8_tflops is not None

    def roofline(self, tp: int, weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> Roofline:
        """The roofline of this model on ``tp`` GPUs."""
        return Roofline(
            hardware=self.hardware,
            model=self.model,
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype,
            tensor_parallel_size=tp,
        )

    def block_bytes(self, kv_dtype: str, block_size: int) -> float:
        """KV bytes of one block."""
        return self.roofline(1, kv_dtype=kv_dtype).kv_bytes_per_token * block_size

    def weight_bytes(self, weight_dtype: str) -> float:
        """Bytes of the weights at ``weight_dtype`` (across the TP group)."""
        return self.roofline(1, weight_dtype=weight_dtype).weight_bytes

    def kv_blocks(
        self, tp: int, utilisation: float, weight_dtype: str, kv_dtype: str, block_size: int
    ) -> int:
        """KV blocks left after the weights; 0 or less means the engine will not start."""
        roofline = self.roofline(tp, weight_dtype, kv_dtype)
        capacity = roofline.kv_capacity_bytes(utilisation)
        return int(capacity // (roofline.kv_bytes_per_token * block_size))

    def smallest_tp(
        self,
        needed_blocks: int,
        utilisation: float,
        weight_dtype: str,
        kv_dtype: str,
        block_size: int,
    ) -> int | None:
        """The smallest power-of-two TP, at most the KV-head count, that fits weights + KV.

        vLLM shards KV heads over the TP group, so TP above the KV-head count only replicates
        them; ``None`` when not even that TP fits.
        """
        tp = 1
        while tp <= self.model.kv_heads:
            if self.kv_blocks(tp, utilisation, weight_dtype, kv_dtype, block_size) >= needed_blocks:
                return tp
            tp *= 2
        return None
