"""When the KV cache is what limits a pool: one definition, used by ``advise`` and ``triage``.

A full cache is a cache doing its job: vLLM keeps finished prefixes cached until it needs the
blocks, so high usage alone says nothing. The cache *limits* when the engine preempts (it had no
free block for a running sequence: the work is redone later) or when it is at least 90% full while
requests wait or the queue grows. Those are the cases FP8 KV, more memory or smaller weights fix.
"""

from __future__ import annotations

#: Usage (of the fullest replica) at or over which a waiting queue means the cache is pinned.
KV_PINNED = 0.90


def kv_pinned(
    kv_usage: float | None,
    preemptions_per_min: float | None,
    waiting_mean: float | None = None,
    waiting_growth_per_min: float | None = None,
) -> bool | None:
    """True when the engine preempts, or the cache is at least ``KV_PINNED`` full while requests
    wait (at least one on average) or the queue grows; None when neither usage nor preemptions
    are known. Unknown queue figures count as no queue."""
    if (preemptions_per_min or 0) > 0:
        return True
    if kv_usage is None:
        return None
    queued = (waiting_growth_per_min or 0) > 0 or (waiting_mean or 0) >= 1
    return kv_usage >= KV_PINNED and queued


def pressure_reasons(
    kv_usage: float | None,
    preemptions_per_min: float | None,
    waiting_mean: float | None = None,
    waiting_growth_per_min: float | None = None,
) -> str:
    """The figures behind a ``kv_pinned`` verdict, for evidence and reasons."""
    parts = [f"KV usage {kv_usage:.0%}" if kv_usage is not None else "KV usage unknown"]
    if waiting_mean is not None:
        parts.append(f"{waiting_mean:.1f} waiting")
    if waiting_growth_per_min is not None:
        parts.append(f"queue {waiting_growth_per_min:+.1f}/min")
    if preemptions_per_min is not None:
        parts.append(f"{preemptions_per_min:.3g} preemptions/min")
    return ", ".join(parts)
