"""``--max-num-seqs``: set below the ``running`` level at which preemptions start.

A preempted sequence loses its KV and recomputes its whole prompt later: the engine does the
work twice and everyone's latency pays. A request held in the queue instead costs nothing until
admitted. So the cap on running sequences belongs just below the level where the cache runs out:
the lowest per-replica ``running`` seen when ``vllm:num_preemptions_total`` moved. Without that
observation it is estimated from the cache: KV blocks / blocks of an average finished request.

Advised: 90% of that level, rounded down to a multiple of 8 from 16 up (CUDA-graph batch sizes
are multiples of 8), advised only when it is below today's cap. vLLM's default cap depends on the
GPU (1024 on 70 GiB+ GPUs other than A100, else 256: ``model.batch_defaults``); a measured running
level above an *assumed* cap means the assumption is wrong, and the row says so instead of
advising a cut from it.
"""

from __future__ import annotations

from planning.advise.model import Advice, PoolSnapshot
from planning.advise.rows import change, flag_name, keep, unchecked
from planning.advise.sizing import blocks_for

MARGIN = 0.90
FIELD = "max_num_seqs"


def nice_floor(value: float) -> int:
    """Round down to a multiple of 8 from 16 up; at least 1."""
    whole = int(value)
    return max(1, whole // 8 * 8 if whole >= 16 else whole)


def preemption_onset(pool: PoolSnapshot) -> tuple[int, str] | None:
    """The running level where preemption starts and how it is known; None when unknown."""
    m, flags = pool.measured, pool.flags
    if m.running_at_preemption is not None:
        return m.running_at_preemption, "measured"
    if flags.num_gpu_blocks and m.prompt_mean is not None and m.output_mean is not None:
        per_seq = blocks_for(m.prompt_mean + m.output_mean, flags.block_size or 16)
        return flags.num_gpu_blocks // per_seq, "estimated from KV blocks / blocks per request"
    return None


def wrong_assumption(pool: PoolSnapshot) -> Advice | None:
    """A "not checked" row when the measured running level is above an *assumed* cap.

    No replica runs more sequences than its ``--max-num-seqs``: a running peak (or preemption
    onset) above the assumed default proves the engine runs with another cap, so no cut is
    advised from the assumed one.
    """
    flags, m = pool.flags, pool.measured
    cap = flags.max_num_seqs
    if cap is None or flags.source(FIELD) != "assumed default":
        return None
    seen = [
        (level, name)
        for level, name in ((m.running_peak, "running peak"), (m.running_at_preemption, "onset"))
        if level is not None and level > cap
    ]
    if not seen:
        return None
    level, name = max(seen)
    evidence = (
        f"measured {name} {level} is above the assumed default --max-num-seqs {cap} (vLLM's "
        f"default on {pool.hardware or 'an unnamed GPU'}), so the engine runs with another cap: "
        "the assumption is wrong; give --max-num-seqs (--flags)"
    )
    if m.running_at_preemption is not None and m.preemptions_per_min:
        evidence += (
            f". Preemptions start at running = {m.running_at_preemption}: "
            f"{nice_floor(m.running_at_preemption * MARGIN)} if the cap is above that"
        )
    return Advice(flag_name(FIELD), "not checked", cap, flags.source(FIELD), None, evidence)


def max_num_seqs(pool: PoolSnapshot) -> Advice:
    """Lower the cap below the preemption onset, or keep it."""
    flags, m = pool.flags, pool.measured
    if flags.max_num_seqs is None:
        return unchecked(flags, FIELD, "--max-num-seqs (--flags)")
    wrong = wrong_assumption(pool)
    if wrong is not None:
        return wrong
    if m.preemptions_per_min is None:
        return unchecked(flags, FIELD, "the preemption rate (vllm:num_preemptions_total)")
    peak = f", running peak {m.running_peak}" if m.running_peak is not None else ""
    if m.preemptions_per_min == 0:
        return keep(flags, FIELD, f"no preemptions{peak} with --max-num-seqs {flags.max_num_seqs}")
    onset = preemption_onset(pool)
    if onset is None:
        return unchecked(flags, FIELD, "the running level at preemption (watch with --samples)")
    level, how = onset
    advised = nice_floor(min(level, flags.max_num_seqs) * MARGIN)
    seen = f"{m.preemptions_per_min:g} preemptions/min, starting at running = {level} ({how}){peak}"
    if advised >= flags.max_num_seqs:
        return keep(flags, FIELD, seen)
    why = (
        f"{seen} vs --max-num-seqs {flags.max_num_seqs}: each preemption recomputes a whole "
        f"prompt; advised = {MARGIN:.0%} of the onset, so the queue holds the excess instead"
    )
    effect = "no preemptions at today's traffic; raise it again with the cache (e.g. FP8 KV: 2x)"
    return change(flags, FIELD, advised, why, effect)
