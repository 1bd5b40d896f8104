"""The designed workload: a few dozen requests whose step contents are known by construction.

- **Prefills**: one request at a time on an idle engine, ``max_tokens=1``, at several prompt
  lengths; each prompt is sent twice, the second time hitting its own cached prefix. The cached
  token count is read from ``vllm:prefix_cache_hits_total`` (the engine's own answer, whatever
  its block size), so the TTFT's step computed ``length − cached`` tokens over ``cached`` tokens
  of context.
- **Decodes**: ``B`` requests of ``P`` fresh prompt tokens sent together, ``N`` output tokens
  each; the mean gap between a request's tokens is one decode step of ``B`` sequences over a
  mean context of ``P + (N − 2) / 2`` tokens each. The gap is read from the engine's
  ``vllm:inter_token_latency_seconds`` (sum and count around the batch), falling back to the
  client's token arrival times when the engine does not publish it.

Prompts are random token ids (fresh per request, so nothing is cached unless meant to be).
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from planning.calibrate.fit import Observation
from planning.calibrate.probe import EngineProbe

__all__ = ["CalibrationPlan", "run_workload"]

#: Token ids prompts are drawn from: low ids exist in every vocabulary, however small.
PROMPT_TOKEN_RANGE = (10, 200)


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """How much to measure; the defaults take well under a minute on the tiny CPU model."""

    prefill_lengths: tuple[int, ...] = (32, 128, 384, 768, 1536)
    #: Each prefill length is measured this many times (fresh prompt + its cached repeat).
    prefill_repeats: int = 3
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (32, 512)
    decode_tokens: int = 32
    decode_repeats: int = 2
    #: Requests sent first and not measured (the first requests of a fresh engine are slow).
    warmup_requests: int = 3

    def __post_init__(self) -> None:
        if self.decode_tokens < 3:
            raise ValueError(f"decode_tokens: must be >= 3 (got {self.decode_tokens})")
        if not self.prefill_lengths or not self.decode_batches or not self.decode_contexts:
            raise ValueError("a calibration plan needs prefill lengths, batches and contexts")
        if min(self.prefill_lengths) < 2 or min(self.decode_contexts) < 1:
            raise ValueError("prefill lengths must be >= 2 and decode contexts >= 1")

    def fitted_to(self, max_model_len: int, max_num_batched_tokens: int) -> CalibrationPlan:
        """The plan with every prompt short enough for one step and the model's context."""
        limit = min(max_model_len - self.decode_tokens - 1, max_num_batched_tokens)
        lengths = tuple(sorted({min(n, limit) for n in self.prefill_lengths}))
        contexts = tuple(sorted({min(n, limit) for n in self.decode_contexts}))
        batches = tuple(
            b for b in self.decode_batches if b * max(contexts) <= max_num_batched_tokens
        ) or (1,)
        return CalibrationPlan(
            lengths, self.prefill_repeats, batches, contexts, self.decode_tokens,
            self.decode_repeats, self.warmup_requests,
        )


class _Prompts:
    """Fresh random token-id prompts."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def fresh(self, length: int) -> list[int]:
        low, high = PROMPT_TOKEN_RANGE
        return [self._rng.randrange(low, high) for _ in range(length)]


async def run_workload(
    probe: EngineProbe,
    model: str,
    plan: CalibrationPlan,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[Observation]:
    """Send the designed workload to the engine; one observation per measured configuration."""
    say = progress or (lambda _line: None)
    prompts = _Prompts(seed)
    for _ in range(plan.warmup_requests):
        await probe.complete(model, prompts.fresh(min(plan.prefill_lengths)), plan.decode_tokens)
    observations: list[Observation] = []
    for length in plan.prefill_lengths:
        say(f"prefill {length} tokens x{plan.prefill_repeats} (fresh + cached)")
        for _ in range(plan.prefill_repeats):
            prompt = prompts.fresh(length)
            for attempt in ("fresh", "cached"):
                before = await probe.prefix_hits()
                timed = await probe.complete(model, prompt, 1)
                cached = int(await probe.prefix_hits() - before)
                observations.append(
                    Observation(
                        "prefill", f"prefill {length} ({attempt}: {cached} cached)",
                        timed.ttft_s, prefill_tokens=length - cached, context_tokens=cached,
                    )
                )
    tokens = plan.decode_tokens
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            say(f"decode batch {batch} over {context}-token prompts x{plan.decode_repeats}")
            for _ in range(plan.decode_repeats):
                batch_prompts = [prompts.fresh(context) for _ in range(batch)]
                itl_before = await probe.itl_totals()
                timed = await asyncio.gather(
                    *(probe.complete(model, p, tokens) for p in batch_prompts)
                )
                itl_after = await probe.itl_totals()
                gaps = itl_after[1] - itl_before[1]
                if gaps > 0:
                    # The engine's own gaps: a busy API server streams several tokens in one
                    # chunk, so the client's gaps are bunched; the engine's are not.
                    gap = (itl_after[0] - itl_before[0]) / gaps
                else:
                    gap = statistics.median(t.mean_itl_s for t in timed)
                mean_context = context + (tokens - 2) / 2
                observations.append(
                    Observation(
                        "decode", f"decode batch {batch} context {context}", gap,
                        decode_seqs=batch, context_tokens=batch * mean_context,
                    )
                )
    return observations
