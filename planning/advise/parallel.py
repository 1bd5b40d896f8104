"""``--tensor-parallel-size``: the smallest TP whose GPUs hold the weights and the KV it needs.

TP splits every layer over GPUs and all-reduces twice per layer: it is how a model that does not
fit on one GPU runs, not a free speed-up. The same GPUs as more replicas at a smaller TP serve
more, so TP should be the smallest power of two at which weights + KV fit in
``gpu_memory_utilization`` of HBM, and never above the KV-head count (vLLM shards KV heads; past
that it replicates them). The KV it must hold: one sequence at the advised ``--max-model-len``,
or the observed running peak at the average request length, whichever is more.
"""

from __future__ import annotations

from planning.advise.context import advised_max_model_len
from planning.advise.model import Advice, PoolSnapshot
from planning.advise.rows import change, keep, unchecked
from planning.advise.sizing import (
    UNKNOWN_DTYPE,
    Sizing,
    blocks_for,
    kv_dtype_of,
    weight_dtype_of,
)

FIELD = "tensor_parallel_size"


def needed_blocks(pool: PoolSnapshot) -> tuple[int, str] | None:
    """KV blocks the pool must hold per replica, and why; None when nothing sizes it."""
    flags, m = pool.flags, pool.measured
    block = flags.block_size or 16
    length = advised_max_model_len(pool) or flags.max_model_len
    options: list[tuple[int, str]] = []
    if length:
        options.append((blocks_for(length, block), f"one {length:,}-token sequence"))
    if m.running_peak and m.prompt_mean is not None and m.output_mean is not None:
        per_seq = blocks_for(m.prompt_mean + m.output_mean, block)
        options.append((m.running_peak * per_seq, f"{m.running_peak} running x {per_seq} blocks"))
    return max(options) if options else None


def tensor_parallel_size(pool: PoolSnapshot, sizing: Sizing | None) -> Advice:
    """The smallest TP that fits, or keep."""
    flags = pool.flags
    if sizing is None:
        return unchecked(flags, FIELD, "the hardware and model (--hardware, --model)")
    need = needed_blocks(pool)
    if need is None or flags.tensor_parallel_size is None:
        return unchecked(flags, FIELD, "--max-model-len or measured concurrency")
    blocks, what = need
    weights, kv = weight_dtype_of(flags.quantization), kv_dtype_of(flags.kv_cache_dtype)
    if weights == UNKNOWN_DTYPE:
        return unchecked(
            flags, FIELD, f"the weight width of --quantization {flags.quantization} (not known)"
        )
    util = flags.gpu_memory_utilization or 0.9
    smallest = sizing.smallest_tp(blocks, util, weights, kv, flags.block_size or 16)
    current = flags.tensor_parallel_size
    heads = sizing.model.kv_heads
    fit = f"{sizing.model.name} ({weights} weights, {kv} KV) + {blocks:,} blocks ({what})"
    if smallest is None:
        return keep(
            flags,
            FIELD,
            f"{fit} does not fit even at TP {heads} (the KV-head count): "
            "cut --max-model-len or quantize first",
        )
    if smallest == current:
        return keep(flags, FIELD, f"{fit} needs TP {smallest} on {sizing.hardware.name}")
    if smallest > current:
        why = f"{fit} does not fit at TP {current} on {sizing.hardware.name}: it will not start"
        return change(flags, FIELD, smallest, why, f"fits at TP {smallest}")
    why = (
        f"{fit} fits at TP {smallest} on {sizing.hardware.name}; TP {current} spends all-reduces "
        f"on a model that does not need them (cap: {heads} KV heads, powers of two)"
    )
    effect = f"the same GPUs as {current // smallest}x the replicas at TP {smallest}"
    return change(flags, FIELD, smallest, why, effect)
