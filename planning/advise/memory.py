"""``--kv-cache-dtype``, ``--gpu-memory-utilization``, ``--quantization``: the three memory levers.

"It will not start: out of memory" and "it starts and is slow under load" are the same problem:
weights + KV do not fit. The levers, in the order ``advise`` pulls them:

1. ``--kv-cache-dtype fp8``: exactly twice the blocks in the same memory, at a quality cost most
   models do not show; needs a GPU with FP8 (Hopper, Ada and newer).
2. ``--gpu-memory-utilization`` up to vLLM's 0.9 when it was lowered: the HBM was there all along.
3. ``--quantization fp8`` (weights): frees half the weights' bytes for KV, at a quality cost the
   owner must accept; advised only once the KV cache is already FP8.

They are advised only when KV is *pinned* (``planning.kv_pressure``, shared with ``triage``): the
engine preempts, or usage is at or over 90% on the fullest replica while requests wait or the
queue grows. A full cache with an empty queue is a cache doing its job.
"""

from __future__ import annotations

from planning import kv_pressure as pressure
from planning.advise.model import Advice, PoolSnapshot
from planning.advise.rows import change, keep, unchecked
from planning.advise.sizing import (
    QUANTIZED_WIDTH_UNKNOWN,
    UNKNOWN_DTYPE,
    Sizing,
    kv_dtype_of,
    weight_dtype_of,
)

#: vLLM's default; above it activations and CUDA graphs risk running out of memory.
SAFE_UTILISATION = 0.90


def kv_pinned(pool: PoolSnapshot) -> bool | None:
    """True when the engine preempts, or KV is full while the queue grows or requests wait;
    None when unknown (``planning.kv_pressure``: triage uses the same definition)."""
    m = pool.measured
    return pressure.kv_pinned(
        m.kv_usage, m.preemptions_per_min, m.waiting_mean, m.waiting_growth_per_min
    )


def pressure_text(pool: PoolSnapshot) -> str:
    """The numbers behind ``kv_pinned``, for evidence strings."""
    m = pool.measured
    return pressure.pressure_reasons(
        m.kv_usage, m.preemptions_per_min, m.waiting_mean, m.waiting_growth_per_min
    )


def kv_cache_dtype(pool: PoolSnapshot, sizing: Sizing | None) -> Advice:
    """FP8 KV when the cache is pinned and the GPU can, else keep."""
    flags, field = pool.flags, "kv_cache_dtype"
    pinned = kv_pinned(pool)
    if pinned is None:
        return unchecked(flags, field, "KV usage (vllm:kv_cache_usage_perc)")
    if not pinned:
        return keep(flags, field, f"{pressure_text(pool)}: the KV cache is not what limits")
    if kv_dtype_of(flags.kv_cache_dtype) == "fp8":
        return keep(flags, field, f"{pressure_text(pool)}, and the cache is already FP8")
    if sizing is not None and not sizing.fp8_capable:
        return keep(
            flags, field, f"{pressure_text(pool)}, but {sizing.hardware.name} has no FP8 cores"
        )
    effect = "2x the KV blocks in the same memory"
    if flags.num_gpu_blocks:
        effect += f": {flags.num_gpu_blocks:,} -> {2 * flags.num_gpu_blocks:,} blocks per replica"
    capable = f"{sizing.hardware.name} has FP8" if sizing else "check the GPU has FP8 (Hopper/Ada+)"
    why = (
        f"{pressure_text(pool)}: the cache is pinned and sequences wait or are preempted; an FP8 "
        f"cache stores half the bytes per token ({capable})"
    )
    return change(flags, field, "fp8", why, effect)


def gpu_memory_utilization(pool: PoolSnapshot, sizing: Sizing | None) -> Advice:
    """Back up to 0.9 when it was lowered and KV is pinned."""
    flags, field = pool.flags, "gpu_memory_utilization"
    pinned = kv_pinned(pool)
    current = flags.gpu_memory_utilization
    if pinned is None or current is None:
        return unchecked(flags, field, "KV usage and --gpu-memory-utilization")
    if not pinned or current >= SAFE_UTILISATION:
        reason = (
            "the KV cache is not what limits"
            if not pinned
            else f"already at {current:g}; above {SAFE_UTILISATION:g} activations risk OOM"
        )
        return keep(flags, field, f"{pressure_text(pool)}: {reason}")
    effect = ""
    if sizing is not None:
        tp = flags.tensor_parallel_size or 1
        freed = (SAFE_UTILISATION - current) * sizing.hardware.memory_gb * 1e9 * tp
        blocks = int(
            freed // sizing.block_bytes(kv_dtype_of(flags.kv_cache_dtype), flags.block_size or 16)
        )
        effect = f"+{freed / 1e9:.1f} GB for KV, about +{blocks:,} blocks per replica"
    why = f"{pressure_text(pool)} while {1 - current:.0%} of HBM is held back"
    return change(flags, field, SAFE_UTILISATION, why, effect)


def quantization(pool: PoolSnapshot, sizing: Sizing | None) -> Advice:
    """FP8 weights once the KV cache is FP8 and still pinned (a quality decision: say so)."""
    flags, field = pool.flags, "quantization"
    pinned = kv_pinned(pool)
    if pinned is None:
        return unchecked(flags, field, "KV usage (vllm:kv_cache_usage_perc)")
    if not pinned:
        return keep(flags, field, f"{pressure_text(pool)}: the KV cache is not what limits")
    weights = weight_dtype_of(flags.quantization)
    if (
        weights == UNKNOWN_DTYPE
        and (flags.quantization or "").lower() not in QUANTIZED_WIDTH_UNKNOWN
    ):
        return unchecked(
            flags, field, f"the weight width of --quantization {flags.quantization} (not known)"
        )
    if weights != "bf16":
        return keep(flags, field, f"{pressure_text(pool)}; weights already {flags.quantization}")
    if kv_dtype_of(flags.kv_cache_dtype) != "fp8":
        return keep(
            flags,
            field,
            f"{pressure_text(pool)}: FP8 KV first (2x the cache, no "
            "weight change); quantize weights if still pinned after it",
        )
    if sizing is None:
        return unchecked(flags, field, "the hardware and model (--hardware, --model)")
    if not sizing.fp8_capable:
        return keep(flags, field, f"{sizing.hardware.name} has no FP8 tensor cores")
    freed = sizing.weight_bytes("bf16") - sizing.weight_bytes("fp8")
    blocks = int(freed // sizing.block_bytes("fp8", flags.block_size or 16))
    why = (
        f"{pressure_text(pool)} with an FP8 cache already: FP8 weights free half the weight bytes "
        "for KV (check the model's quality on your evals first)"
    )
    return change(flags, field, "fp8", why, f"+{freed / 1e9:.1f} GB, about +{blocks:,} blocks")
