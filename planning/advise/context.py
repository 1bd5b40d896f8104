"""``--max-model-len`` from the measured p99 prompt + output length and the requested budgets.

vLLM refuses a request whose prompt + ``max_tokens`` exceeds ``--max-model-len``, and at start-up
it refuses to run unless the KV cache holds at least one sequence of that length. The paged cache
holds only what sequences use, so the flag does not reserve memory per user; what it sets is the
*guaranteed* concurrency (vLLM logs it as "Maximum concurrency for N tokens per request": KV blocks
/ blocks of one max-length sequence) and whether the engine starts at all on a given GPU and TP.
A model's own limit (128k for Llama 3) is rarely what a fleet serves.

Advised value: the largest of p99 × 1.25, the longest request seen (the top non-empty histogram
bucket) and the longest prompt + *requested* output budget (``requested_context_max``, from the
gateway's ``fleetgate_request_budget_tokens``), rounded up to a block multiple, so no request
already served would be refused. vLLM checks the budget a request asks for, not what it generates:
a 1,400-token prompt with ``max_tokens: 4096`` that stops after 180 tokens counts 1,580 tokens of
context but is refused below 5,496. Where the budget was not measured, the row says the cut may
refuse requests that ask for long outputs. It is advised only when it cuts the flag by at least a
quarter: smaller cuts buy little. Where the traffic's lengths reach past the flag, the row keeps
it and says that requests over it get 400s: the lengths are bucket bounds, not a value to raise
it to.
"""

from __future__ import annotations

from planning.advise.model import Advice, PoolSnapshot
from planning.advise.rows import change, keep, tokens, unchecked
from planning.advise.sizing import blocks_for, round_up

HEADROOM = 1.25
#: Advise a cut only when the new value is at most this share of today's.
WORTH_CUTTING = 0.75

FIELD = "max_model_len"
#: Requests a cut is measured on at least: below that the longest seen and the p99 are one or
#: two requests' lengths (the advised value still covers the longest seen and 1.25 x the p99).
MIN_REQUESTS_TO_CUT = 10


def advised_max_model_len(pool: PoolSnapshot) -> int | None:
    """The length the traffic needs, block-aligned and at most today's; None when unmeasured."""
    m, flags = pool.measured, pool.flags
    if m.context_p99 is None or flags.max_model_len is None:
        return None
    block = flags.block_size or 16
    target = max(m.context_p99 * HEADROOM, m.context_max or 0.0, m.requested_context_max or 0.0)
    return min(round_up(target, block), flags.max_model_len)


def max_model_len(pool: PoolSnapshot) -> Advice:
    """One row: cut ``--max-model-len`` to what the traffic uses, or keep it."""
    flags, m = pool.flags, pool.measured
    if flags.max_model_len is None:
        return unchecked(flags, FIELD, "--max-model-len (the engine's /v1/models, or --flags)")
    advised = advised_max_model_len(pool)
    if advised is None or m.context_p99 is None:
        return unchecked(flags, FIELD, "measured request lengths (prompt + output histograms)")
    current = flags.max_model_len
    longest = f", longest ≤ {tokens(m.context_max)}" if m.context_max is not None else ""
    seen = f"p99 prompt+output {tokens(m.context_p99)} tokens{longest}"
    if m.requests is not None:
        seen += f" over {m.requests:,} requests"
    if m.requested_context_max is not None:
        seen += f"; longest prompt + requested max_tokens ≤ {tokens(m.requested_context_max)}"
    needed = max(m.context_max or 0.0, m.requested_context_max or 0.0, m.context_p99)
    if needed > current:
        # Requests may ask for more than the flag, and vLLM refuses each with a 400. "May":
        # the lengths are histogram bucket bounds (a 4,100-token request reads as "<= 10,000"),
        # so no value to raise it to is known, and raising it costs guaranteed concurrency
        # (the diff review: a raise advised where no request was over the flag). Said, not
        # advised.
        return keep(
            flags,
            FIELD,
            f"{seen}: some may be over --max-model-len {tokens(current)} (the lengths are "
            "histogram bucket bounds), and vLLM answers 400 to a request whose prompt + "
            "max_tokens passes it. If fleetgate_requests_total shows 400s on this pool, raise "
            "it to what the clients need, where the model's own context and the KV cache "
            "allow, or have the clients ask for less (max_tokens)",
        )
    if m.requests is not None and m.requests < MIN_REQUESTS_TO_CUT:
        # A p99 of a handful of requests is their longest: one request once cut 131,072 to 16
        # (the CLI review).
        return keep(
            flags,
            FIELD,
            f"{seen}: too few requests to cut --max-model-len {tokens(current)} on (at least "
            f"{MIN_REQUESTS_TO_CUT}); measure over more traffic",
        )
    if advised > current * WORTH_CUTTING:
        near = (
            " (p99 within 10% of it: check for refused requests)"
            if (m.context_p99 >= 0.9 * current)
            else ""
        )
        return keep(flags, FIELD, f"{seen} vs --max-model-len {tokens(current)}{near}")
    block = flags.block_size or 16
    before, after = blocks_for(current, block), blocks_for(advised, block)
    effect = f"a max-length sequence holds {before:,} -> {after:,} blocks"
    if flags.num_gpu_blocks:
        effect += (
            f"; guaranteed concurrent sequences {flags.num_gpu_blocks // before:,} -> "
            f"{flags.num_gpu_blocks // after:,} (of {flags.num_gpu_blocks:,} blocks)"
        )
    effect += "; a GPU or TP too small to start at today's value may start at this one"
    why = (
        f"{seen}; --max-model-len {tokens(current)} is {current / m.context_p99:.0f}x the p99. "
        f"Advised = max(p99 x {HEADROOM:g}, longest, longest requested) rounded up to the "
        f"{block}-token block"
    )
    if m.requested_context_max is None:
        why += (
            ". The clients' max_tokens were not measured (fleetgate_request_budget_tokens): "
            "vLLM refuses prompt + max_tokens over --max-model-len, so this cut may refuse "
            "requests that ask for long outputs even if they generate little"
        )
    return change(flags, FIELD, advised, why, effect)
