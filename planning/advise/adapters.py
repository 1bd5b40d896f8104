"""``--max-loras`` and ``--max-cpu-loras`` from the adapter working set.

``--max-loras`` GPU slots hold the adapters running requests use; a request for an adapter
without a slot waits until one frees and the adapter is swapped in (from the host cache of
``--max-cpu-loras`` adapters, or from storage). When the working set (adapters requested in the
window) exceeds the slots and the engines keep loading and unloading, the pool thrashes.

Advised ``--max-loras``: the working set. Each slot costs about one adapter's weights of HBM,
which comes out of the KV cache; the effect says how many blocks. Advised ``--max-cpu-loras``:
at least the working set, so a swap reads host memory, not storage.
"""

from __future__ import annotations

from planning.advise.model import Advice, PoolSnapshot
from planning.advise.rows import change, keep, unchecked
from planning.advise.sizing import Sizing, kv_dtype_of

#: Loads/unloads per minute per pool that count as churn when the working set exceeds the slots.
CHURN_PER_MIN = 0.0


def _working_set(pool: PoolSnapshot) -> str:
    m = pool.measured
    text = f"{m.adapter_working_set} adapters requested"
    if m.adapter_loads_per_min is not None:
        text += f", {m.adapter_loads_per_min:g} loads/min"
    if m.adapter_unloads_per_min is not None:
        text += f", {m.adapter_unloads_per_min:g} unloads/min"
    return text


def thrashing(pool: PoolSnapshot) -> bool:
    """Working set over the slots while adapters churn (unknown churn counts as churn)."""
    m, slots = pool.measured, pool.flags.max_loras or 0
    if m.adapter_working_set is None or m.adapter_working_set <= slots:
        return False
    churn = [x for x in (m.adapter_loads_per_min, m.adapter_unloads_per_min) if x is not None]
    return not churn or max(churn) > CHURN_PER_MIN


def max_loras(pool: PoolSnapshot, sizing: Sizing | None) -> Advice:
    """Slots for the working set, or keep."""
    flags, m, field = pool.flags, pool.measured, "max_loras"
    if flags.enable_lora is False:
        return keep(flags, field, "LoRA is off on this pool (no --enable-lora)")
    if m.adapter_working_set is None or flags.max_loras is None:
        return unchecked(flags, field, "the adapter working set and --max-loras")
    if not thrashing(pool):
        return keep(flags, field, f"{_working_set(pool)}, {flags.max_loras} slots: no thrash")
    advised = m.adapter_working_set
    effect = f"{advised - flags.max_loras} more slots"
    if sizing is not None:
        slot_bytes = sizing.model.lora_adapter_mb * 1e6
        block = sizing.block_bytes(kv_dtype_of(flags.kv_cache_dtype), flags.block_size or 16)
        cost = int((advised - flags.max_loras) * slot_bytes // block)
        effect += f", about {cost:,} KV blocks of HBM ({sizing.model.lora_adapter_mb:g} MB each)"
    why = (
        f"{_working_set(pool)} on {flags.max_loras} GPU slots: requests wait for a swap; "
        "slots for the whole working set stop the churn"
    )
    return change(flags, field, advised, why, effect)


def max_cpu_loras(pool: PoolSnapshot) -> Advice:
    """A host cache at least the working set."""
    flags, m, field = pool.flags, pool.measured, "max_cpu_loras"
    if flags.enable_lora is False:
        return keep(flags, field, "LoRA is off on this pool (no --enable-lora)")
    if m.adapter_working_set is None or flags.max_cpu_loras is None:
        return unchecked(flags, field, "the adapter working set and --max-cpu-loras")
    needed = max(m.adapter_working_set, flags.max_loras or 0)
    if flags.max_cpu_loras >= needed or not thrashing(pool):
        return keep(
            flags, field, f"{_working_set(pool)}; the host cache holds {flags.max_cpu_loras}"
        )
    why = f"{_working_set(pool)}: a host cache of {flags.max_cpu_loras} reloads from storage"
    return change(flags, field, needed, why, "swaps read host memory, not storage")
