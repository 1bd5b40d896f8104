"""The designed workload: a few dozen requests whose step contents are known by construction.

- **Prefills**: one request at a time on an idle engine, at several prompt lengths, each
  streaming a few tokens (``prefill_probe_tokens``): its TTFT is timed as a served request's is,
  with the engine already running the next step while the API server sends the first token
  (with ``max_tokens=1`` nothing follows, and lone TTFTs came out ~20% below a replay's).
  Each is sent after ``prefill_idle_s`` of quiet, as a request below capacity finds the engine
  (sent right after the previous request and a metrics read, lone TTFTs came out ~30% below
  those of a replay at 2 requests/s on the CPU engine: processes that were just running wake
  faster than ones that slept).
  Each prompt is sent twice, the second time hitting its own cached prefix. The cached
  token count is read from ``vllm:prefix_cache_hits_total`` (the engine's own answer, whatever
  its block size), so the TTFT's step computed ``length − cached`` tokens over ``cached`` tokens
  of context.
- **Decodes**: ``B`` requests of ``P`` fresh prompt tokens sent together, ``N`` output tokens
  each, timed over the steps in which all of them decoded (``_decode_batch``): by the client's
  view of the last-admitted request while it agrees with the engine's inter-token histogram,
  else by that histogram. ``S`` such steps decode ``B`` sequences over a mean context of
  ``P + (S − 1) / 2`` tokens each.
- **Bursts**: ``k`` requests of short fresh prompts, ``T`` tokens each, sent at once: the
  client's makespan is what the request path's work per request and per token is fitted
  from (``request_path.py``), at two ``T`` so the two terms separate.

Prompts are random token ids (fresh per request, so nothing is cached unless meant to be).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planning.calibrate.fit import Observation
from planning.calibrate.probe import EngineProbe, HistogramTotals, TimedCompletion
from planning.calibrate.request_path import Burst

__all__ = ["CalibrationPlan", "Measurements", "run_workload"]

#: A stream that arrived in fewer chunks than this share of its tokens was merged by the API
#: server: its client-side span is not the engine's.
MIN_CHUNKED_SHARE = 0.9

#: Reads of the inter-token histogram, this far apart, while it has not yet counted a batch.
ITL_SETTLE_READS = 20
ITL_SETTLE_INTERVAL_S = 0.05

#: Token ids prompts are drawn from: low ids exist in every vocabulary, however small.
PROMPT_TOKEN_RANGE = (10, 200)


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """How much to measure; the defaults take well under a minute on the tiny CPU model."""

    prefill_lengths: tuple[int, ...] = (32, 128, 384, 768, 1536)
    #: Each prefill length is measured this many times (fresh prompt + its cached repeat).
    prefill_repeats: int = 5
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (32, 256)
    decode_tokens: int = 32
    decode_repeats: int = 3
    #: Tokens each prefill probe streams (only its first is timed; see the module's docstring).
    prefill_probe_tokens: int = 4
    #: Seconds the engine is left idle before each prefill probe (see the module's docstring).
    prefill_idle_s: float = 0.25
    #: Requests sent first and not measured (the first requests of a fresh engine are slow).
    warmup_requests: int = 3
    #: Skip decode batches whose prompts (``B × P``) exceed this (one step's token budget).
    max_batch_tokens: int | None = None
    #: Bursts (request path): concurrent requests per burst, tokens each, prompt tokens each.
    burst_sizes: tuple[int, ...] = (16, 32)
    burst_tokens: tuple[int, ...] = (8, 32)
    burst_prompt_tokens: int = 32
    #: Repeats of each burst shape. A CPU engine's stalls (hundreds of ms) hit about a third of
    #: the bursts: of five, the second fastest is stall-free unless four stall.
    burst_repeats: int = 5

    def __post_init__(self) -> None:
        if self.prefill_probe_tokens < 1:
            raise ValueError(
                f"prefill_probe_tokens: must be >= 1 (got {self.prefill_probe_tokens})"
            )
        if self.decode_tokens < 3:
            raise ValueError(f"decode_tokens: must be >= 3 (got {self.decode_tokens})")
        if not self.prefill_lengths or not self.decode_batches or not self.decode_contexts:
            raise ValueError("a calibration plan needs prefill lengths, batches and contexts")
        if min(self.prefill_lengths) < 2 or min(self.decode_contexts) < 1:
            raise ValueError("prefill lengths must be >= 2 and decode contexts >= 1")
        if self.burst_sizes and (min(self.burst_sizes) < 2 or min(self.burst_tokens, default=0) < 1
                                 or self.burst_repeats < 1 or self.burst_prompt_tokens < 2):
            raise ValueError("bursts need >= 2 requests of >= 2 prompt tokens and >= 1 token")

    def fitted_to(
        self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int | None = None
    ) -> CalibrationPlan:
        """The plan with every prompt short enough for one step and the model's context, and,
        given the engine's ``max_num_seqs``, no batch larger than it and one batch of exactly
        that: a saturated engine decodes its full batch, and a step time extrapolated from
        smaller batches under-predicted a burst's queueing by 6-24% on the CPU engine
        (docs/benchmarks/sim-fidelity.md, session 21)."""
        limit = min(max_model_len - self.decode_tokens - 1, max_num_batched_tokens)
        lengths = tuple(sorted({min(n, limit) for n in self.prefill_lengths}))
        contexts = tuple(sorted({min(n, limit) for n in self.decode_contexts}))
        batches = self.decode_batches
        if max_num_seqs is not None:
            batches = tuple(sorted({min(b, max_num_seqs) for b in batches} | {max_num_seqs}))
        return dataclasses.replace(
            self, prefill_lengths=lengths, decode_contexts=contexts, decode_batches=batches,
            max_batch_tokens=max_num_batched_tokens,
            burst_prompt_tokens=min(self.burst_prompt_tokens, limit),
        )


class _Prompts:
    """Fresh random token-id prompts."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def fresh(self, length: int) -> list[int]:
        low, high = PROMPT_TOKEN_RANGE
        return [self._rng.randrange(low, high) for _ in range(length)]


@dataclass(frozen=True, slots=True)
class Measurements:
    """What the designed workload measured: step observations and bursts."""

    steps: list[Observation]
    bursts: list[Burst]


async def run_workload(
    probe: EngineProbe,
    model: str,
    plan: CalibrationPlan,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Measurements:
    """Send the designed workload to the engine; one observation per measured configuration.

    Every repeat of every configuration is a separate item, and the items run in a seeded
    random order: on a shared machine a stretch of contention then spreads over many
    configurations (which the per-configuration median shrugs off) instead of spoiling every
    repeat of one.
    """
    say = progress or (lambda _line: None)
    prompts = _Prompts(seed)
    for _ in range(plan.warmup_requests):
        await probe.complete(model, prompts.fresh(min(plan.prefill_lengths)), plan.decode_tokens)
    items: list[tuple[str, int, int]] = [
        ("prefill", length, 1)
        for length in plan.prefill_lengths
        for _ in range(plan.prefill_repeats)
    ] + [
        ("decode", context, batch)
        for context in plan.decode_contexts
        for batch in plan.decode_batches
        for _ in range(plan.decode_repeats)
        # All of a batch's prompts fit one step, so its decode steps all run the whole batch.
        if plan.max_batch_tokens is None or batch * context <= plan.max_batch_tokens
    ] + [
        ("burst", size, tokens)
        for size in plan.burst_sizes
        for tokens in plan.burst_tokens
        for _ in range(plan.burst_repeats)
    ]
    random.Random(f"{seed}:order").shuffle(items)
    decode_items = sum(1 for item in items if item[0] == "decode")
    say(
        f"{len(plan.prefill_lengths)} prefill lengths x{plan.prefill_repeats} (fresh + cached), "
        f"{decode_items // plan.decode_repeats} decode batches x{plan.decode_repeats}, "
        f"{len(plan.burst_sizes) * len(plan.burst_tokens)} burst shapes x{plan.burst_repeats}, "
        "in random order"
    )
    observations: list[Observation] = []
    bursts: list[Burst] = []
    for kind, length, batch in items:
        if kind == "burst":
            bursts.append(await _burst(probe, model, prompts, length, plan.burst_prompt_tokens,
                                       batch))
        elif kind == "prefill":
            observations += await _prefill_pair(
                probe, model, prompts.fresh(length), plan.prefill_probe_tokens,
                plan.prefill_idle_s,
            )
        else:
            decode = await _decode_batch(probe, model, prompts, length, batch, plan.decode_tokens)
            if decode is None:
                say(f"decode batch {batch} context {length}: no clean timing (the API server "
                    "merged the streams and the engine's histogram did not count the batch); "
                    "skipped")
            else:
                observations.append(decode)
    return Measurements(observations, bursts)


async def _burst(probe: EngineProbe, model: str, prompts: _Prompts, requests: int,
                 prompt_tokens: int, tokens: int) -> Burst:
    """``requests`` fresh prompts sent at once; the client's makespan and mean TTFT."""
    batch = [prompts.fresh(prompt_tokens) for _ in range(requests)]
    start = probe.clock()
    timed = await asyncio.gather(*(probe.complete(model, p, tokens) for p in batch))
    return Burst(requests, prompt_tokens, tokens,
                 max(t.token_s[-1] for t in timed) - start,
                 statistics.fmean(t.ttft_s for t in timed))


async def _prefill_pair(
    probe: EngineProbe, model: str, prompt: list[int], tokens: int, idle_s: float
) -> list[Observation]:
    """A fresh prompt alone on the engine, then again over its own cached prefix."""
    pair = []
    for attempt in ("fresh", "cached"):
        before = await probe.prefix_hits()
        await asyncio.sleep(idle_s)
        timed = await probe.complete(model, prompt, tokens)
        cached = int(await probe.prefix_hits() - before)
        pair.append(
            Observation(
                "prefill", f"prefill {len(prompt)} ({attempt}: {cached} cached)",
                timed.ttft_s, prefill_tokens=len(prompt) - cached, context_tokens=cached,
            )
        )
    return pair


def _engine_span(
    before: HistogramTotals | None, after: HistogramTotals | None, batch: int, steps: int
) -> float | None:
    """``steps`` times the engine's mean inter-token gap over the batch; None when the engine
    exports no histogram or it moved by other than the batch's ``batch × steps`` gaps (someone
    else's traffic, or an engine that counts differently)."""
    if before is None or after is None:
        return None
    moved = after.since(before)
    if round(moved.count) != batch * steps or moved.total_s <= 0:
        return None
    return moved.total_s / moved.count * steps


def _whole_batch_window(timed: Sequence[TimedCompletion]) -> tuple[float, int] | None:
    """(seconds, steps) of the stretch in which every request of the batch decoded together.

    Requests sent together may be admitted a step or more apart: an early one's span then holds
    the step that prefilled the late ones, and finishes before them. The stretch runs from the
    last-admitted request's first token to the first finisher's last token, and is counted in
    the last-admitted request's own tokens (one chunk per token: the caller checks). None when it
    holds fewer than two steps.
    """
    late = max(timed, key=lambda t: t.token_s[0])
    start = late.token_s[0]
    end = min(t.token_s[-1] for t in timed)
    # The first finisher's last token and the late request's token of the same step arrive on
    # different connections a little apart: half a step is the tolerance.
    gaps = [b - a for a, b in itertools.pairwise(late.token_s)]
    slack = 0.5 * statistics.median(gaps) if gaps else 0.0
    inside = [t for t in late.token_s[1:] if t <= end + slack]
    if len(inside) < 2:
        return None
    return inside[-1] - start, len(inside)


async def _itl_after(
    probe: EngineProbe, before: HistogramTotals | None, gaps: int
) -> HistogramTotals | None:
    """The histogram once it has counted the batch's ``gaps``: vLLM records a step's stats
    after handing its outputs over, so a reading right after the last response can lag it."""
    after = await probe.itl_totals()
    for _ in range(ITL_SETTLE_READS):
        if before is None or after is None or after.since(before).count >= gaps:
            break
        await asyncio.sleep(ITL_SETTLE_INTERVAL_S)
        after = await probe.itl_totals()
    return after


async def _decode_batch(
    probe: EngineProbe, model: str, prompts: _Prompts, context: int, batch: int, tokens: int
) -> Observation | None:
    """``batch`` fresh prompts of ``context`` tokens decoding ``tokens`` tokens together: the
    time and count of the engine steps in which all of it decoded; None without a clean view.

    The client's view counts steps exactly, but only while the API server keeps up: behind, it
    merges tokens into fewer chunks, or sends a burst of chunks at once. The engine's own
    inter-token clock is immune to both, but its mean also counts the step that prefilled a
    member admitted late. So the client's stretch is used while its step time agrees with the
    engine's within a factor of two, and the engine's clock otherwise.
    """
    batch_prompts = [prompts.fresh(context) for _ in range(batch)]
    before = await probe.itl_totals()
    timed = await asyncio.gather(*(probe.complete(model, p, tokens) for p in batch_prompts))
    all_steps = tokens - 1
    after = await _itl_after(probe, before, batch * all_steps)
    engine_span = _engine_span(before, after, batch, all_steps)
    merged = any(len(t.token_s) < tokens * MIN_CHUNKED_SHARE for t in timed)
    window = None if merged else _whole_batch_window(timed)
    if window is not None and engine_span is not None:
        client_step, engine_step = window[0] / window[1], engine_span / all_steps
        if not 0.5 <= client_step / engine_step <= 2.0:
            window = None  # a burst of chunks: the client's clock saw the server, not the engine
    if window is not None:
        span, steps = window
        clock = "client"
    elif engine_span is not None:
        span, steps, clock = engine_span, all_steps, "engine clock"
    else:
        return None
    # Decode step k (k = 1..steps) reads P + k - 1 tokens of context per sequence.
    mean_context = context + (steps - 1) / 2
    return Observation(
        "decode", f"decode batch {batch} context {context} x{tokens}", span,
        steps=steps, decode_seqs=steps * batch,
        context_tokens=steps * batch * mean_context, overheads=0, clock=clock,
    )
