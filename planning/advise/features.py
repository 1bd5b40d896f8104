"""``--enable-prefix-caching`` and ``--enable-chunked-prefill``: on, unless there is a reason.

Prefix caching costs nothing where it buys little (a hash per block, no extra memory: cached
blocks are free blocks that have not been reused yet), so ``advise`` never advises turning it
off, and advises turning it on whenever it is off. Chunked prefill keeps long prefills from
stalling every running decode (the inter-token latency tail); it is vLLM V1's default.
"""

from __future__ import annotations

from planning.advise.model import Advice, PoolSnapshot
from planning.advise.rows import change, keep, tokens, unchecked


def _sharing(pool: PoolSnapshot) -> str:
    m = pool.measured
    parts = []
    if m.shared_prefix_fraction is not None:
        parts.append(f"shared prefix {m.shared_prefix_fraction:.0%} of prompt tokens")
    if m.prefix_hit_rate is not None:
        parts.append(f"prefix hit rate {m.prefix_hit_rate:.0%}")
    return ", ".join(parts) or "prefix sharing not measured"


def enable_prefix_caching(pool: PoolSnapshot) -> Advice:
    """On, whatever the sharing: it is free."""
    flags, field = pool.flags, "enable_prefix_caching"
    if flags.enable_prefix_caching is None:
        return unchecked(flags, field, "cache_config_info.enable_prefix_caching")
    if flags.enable_prefix_caching:
        return keep(flags, field, f"{_sharing(pool)}; on costs nothing where it buys little")
    why = (
        f"{_sharing(pool)}: off, every shared prefix is prefilled again on every request; "
        "on costs a hash per block and no memory"
    )
    return change(flags, field, True, why, "shared prefixes skip prefill")


def enable_chunked_prefill(pool: PoolSnapshot) -> Advice:
    """On: long prefills share steps with decodes instead of stalling them."""
    flags, m, field = pool.flags, pool.measured, "enable_chunked_prefill"
    if flags.enable_chunked_prefill is None:
        return unchecked(flags, field, "--enable-chunked-prefill (--flags)")
    itl = m.timers.get("itl")
    tail = ""
    if itl is not None and itl.p50_ms and itl.p99_ms:
        tail = f"; ITL p99 {itl.p99_ms:.0f} ms = {itl.p99_ms / itl.p50_ms:.1f}x its p50"
    prompts = f"p99 prompt {tokens(m.prompt_p99)} tokens" if m.prompt_p99 is not None else ""
    if flags.enable_chunked_prefill:
        return keep(flags, field, f"on{': ' + prompts if prompts else ''}{tail}")
    why = (
        f"off: a long prompt's prefill takes whole steps and every running decode waits "
        f"({prompts or 'prompt lengths not measured'}{tail})"
    )
    return change(flags, field, True, why, "decodes keep their pace during long prefills")
