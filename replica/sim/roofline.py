"""Roofline timing for one engine step: weights and KV from HBM, prefill FLOPs on tensor cores.

One source of truth for the engine model (``replica/sim/engine.py``) and the lever table
(``planning/levers.py``): both build a ``Roofline`` and call the same methods.

- Decode is memory-bound: a step reads every weight once plus the KV cache of every running
  sequence, ``(weight bytes + KV bytes) / (HBM bandwidth × efficiency)``.
- Prefill is compute-bound: ``2 × params × tokens / (peak FLOPS × MFU)``, at the FLOPS of the
  dtype the matmuls run in: W8A8 FP8 runs on FP8 tensor cores; W4A16 (INT4 weights) and FP8 on a
  chip without FP8 tensor cores dequantise and run in 16-bit.
- A mixed step (prefill chunks + decodes) is ``max(compute, memory)``: the batch shares one pass
  over the weights, and the decodes' memory traffic overlaps the chunk's matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.sim.profiles import HardwareProfile, ModelProfile

#: Bytes per element of each supported dtype (INT4 packs two weights per byte; scales ignored).
DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int4": 0.5}
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int4")
KV_DTYPES = ("bf16", "fp16", "fp8")

GB = 1e9


def weight_bytes(params: float, weight_dtype: str) -> float:
    """Bytes of model weights at ``weight_dtype``."""
    return params * _dtype_bytes(weight_dtype, WEIGHT_DTYPES, "weight_dtype")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> float:
    """KV-cache bytes one token holds: 2 (K and V) × layers × KV heads × head dim × dtype bytes."""
    return 2 * layers * kv_heads * head_dim * _dtype_bytes(kv_dtype, KV_DTYPES, "kv_dtype")


def compute_dtype(weight_dtype: str, hardware: HardwareProfile) -> str:
    """The dtype prefill matmuls run in: ``fp8`` only for W8A8 on chips with FP8 tensor cores."""
    if weight_dtype == "fp8" and hardware.fp8_tflops is not None:
        return "fp8"
    return "bf16"


def prefill_compute_s(params: float, tokens: float, peak_flops: float, mfu: float) -> float:
    """Seconds to push ``tokens`` through the matmuls: ``2 × params × tokens / (FLOPS × MFU)``."""
    return 2.0 * params * tokens / (peak_flops * mfu)


def memory_read_s(num_bytes: float, bandwidth_bytes_s: float, efficiency: float) -> float:
    """Seconds to stream ``num_bytes`` from HBM at ``bandwidth × efficiency``."""
    return num_bytes / (bandwidth_bytes_s * efficiency)


def _dtype_bytes(dtype: str, allowed: tuple[str, ...], what: str) -> float:
    if dtype not in allowed:
        raise ValueError(f"{what}: unknown dtype {dtype!r}; choose from: {', '.join(allowed)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Roofline:
    """Step timing for one model on ``tensor_parallel_size`` GPUs of one hardware profile.

    Tensor parallelism is idealised: memory, bandwidth and FLOPS scale linearly with the GPU
    count (no all-reduce cost).
    """

    hardware: HardwareProfile
    model: ModelProfile
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    #: Fraction of peak HBM bandwidth a decode step achieves.
    efficiency: float = 0.7
    #: Model FLOPs utilisation of prefill.
    mfu: float = 0.4
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _dtype_bytes(self.weight_dtype, WEIGHT_DTYPES, "weight_dtype")
        _dtype_bytes(self.kv_dtype, KV_DTYPES, "kv_dtype")
        for name in ("efficiency", "mfu"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name}: must be in (0, 1] (got {value})")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size: must be >= 1 (got {self.tensor_parallel_size})"
            )

    # ------------------------------------------------------------------ sizes

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights across all GPUs."""
        return weight_bytes(self.model.params, self.weight_dtype)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token holds."""
        m = self.model
        return kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, self.kv_dtype)

    @property
    def hbm_bytes(self) -> float:
        """Total HBM across the tensor-parallel group."""
        return self.hardware.memory_gb * GB * self.tensor_parallel_size

    def kv_capacity_bytes(self, gpu_memory_utilization: float) -> float:
        """Bytes left for the KV cache: ``HBM × utilisation − weights`` (activations ignored)."""
        return self.hbm_bytes * gpu_memory_utilization - self.weight_bytes

    # ------------------------------------------------------------------ rates

    @property
    def compute_dtype(self) -> str:
        """The dtype prefill matmuls run in."""
        return compute_dtype(self.weight_dtype, self.hardware)

    @property
    def peak_flops(self) -> float:
        """Peak dense FLOP/s of the compute dtype, across the group."""
        hw = self.hardware
        tflops = hw.fp8_tflops if self.compute_dtype == "fp8" else hw.bf16_tflops
        assert tflops is not None  # compute_dtype() only picks fp8 when the chip has it
        return tflops * 1e12 * self.tensor_parallel_size

    @property
    def hbm_bandwidth(self) -> float:
        """Peak HBM bytes/s across the group."""
        return self.hardware.hbm_bandwidth_tbps * 1e12 * self.tensor_parallel_size

    # ------------------------------------------------------------------ timing

    def prefill_s(self, tokens: float) -> float:
        """Compute time of ``tokens`` prompt tokens (attention FLOPs ignored)."""
        return prefill_compute_s(self.model.params, tokens, self.peak_flops, self.mfu)

    def decode_s(self, context_tokens: float) -> float:
        """Memory time of one step that reads all weights plus ``context_tokens`` tokens of KV."""
        total = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        return memory_read_s(total, self.hbm_bandwidth, self.efficiency)

    def step_s(self, scheduled_tokens: float, context_tokens: float) -> float:
        """One mixed step: ``max(compute of all scheduled tokens, weights + KV read)``.

        ``scheduled_tokens`` counts every token computed this step (prefill chunks and one per
        decode); ``context_tokens`` counts the already-cached tokens each scheduled request's
        attention reads.
        """
        return max(self.prefill_s(scheduled_tokens), self.decode_s(context_tokens))
