"""``advise(PoolSnapshot) -> list[Advice]``: every flag the issue names, in one fixed order.

Pure apart from reading the named profiles. Unknown flags are first filled with vLLM's defaults
for the pool's GPU (marked ``assumed default``), then each rule family judges its flags. The order
is the order of the output, and the order in which to apply changes: length first (it sizes
everything else), then memory, then features, then TP, then the batch cap, then adapters.
"""

from __future__ import annotations

from dataclasses import replace

from planning.advise import adapters, batch, context, features, memory, parallel
from planning.advise.model import Advice, AdviceError, PoolSnapshot
from planning.advise.sizing import Sizing, flags_with_defaults

#: Flags in output order (``--json`` keeps it).
FLAGS = (
    "--max-model-len",
    "--gpu-memory-utilization",
    "--kv-cache-dtype",
    "--quantization",
    "--enable-prefix-caching",
    "--enable-chunked-prefill",
    "--tensor-parallel-size",
    "--max-num-seqs",
    "--max-loras",
    "--max-cpu-loras",
)


def sizing_of(pool: PoolSnapshot) -> Sizing | None:
    """The pool's hardware and model profiles, or None when either is not named."""
    try:
        return Sizing.of(pool.hardware, pool.model)
    except (ValueError, KeyError) as exc:
        raise AdviceError(f"pool {pool.pool}: {exc}") from exc


def advise(pool: PoolSnapshot) -> list[Advice]:
    """One row per flag in ``FLAGS`` for one pool."""
    pool = replace(pool, flags=flags_with_defaults(pool))
    sizing = sizing_of(pool)
    return [
        context.max_model_len(pool),
        memory.gpu_memory_utilization(pool, sizing),
        memory.kv_cache_dtype(pool, sizing),
        memory.quantization(pool, sizing),
        features.enable_prefix_caching(pool),
        features.enable_chunked_prefill(pool),
        parallel.tensor_parallel_size(pool, sizing),
        batch.max_num_seqs(pool),
        adapters.max_loras(pool, sizing),
        adapters.max_cpu_loras(pool),
    ]


def changes(advice: list[Advice]) -> dict[str, object]:
    """``flag -> advised value`` of the rows that change something."""
    return {row.flag: row.advised for row in advice if row.kind == "change"}
