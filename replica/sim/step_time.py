"""A measured step-time model: the linear fit ``fleetgate sim calibrate`` takes from a live engine.

The roofline (``replica/sim/roofline.py``) predicts a step from datasheet bandwidth and FLOPS;
this model predicts it from what a real engine was measured to do. One step costs::

    base_s                                  # scheduling, sampling, one pass over the weights
    + prefill_token_s × prompt tokens computed this step
    + decode_seq_s × sequences decoding this step
    + context_token_s × tokens of KV the step's attention reads

Every term is linear in what the scheduler put in the step, so least squares fits it from a
handful of designed requests and the engine model can evaluate it per step. When a profile holds
a ``step_time`` mapping, the engine uses it instead of the roofline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["LINEAR_FIELDS", "STEP_TIME_FIELDS", "StepTimeModel"]


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step as a linear function of the step's contents."""

    #: Fixed cost of every step (scheduler, sampler, the weights pass of a tiny batch).
    base_s: float
    #: Cost of each prompt token computed this step (uncached prefill tokens).
    prefill_token_s: float
    #: Cost of each sequence that decodes one token this step.
    decode_seq_s: float
    #: Cost of each already-computed token whose KV the step's attention reads.
    context_token_s: float = 0.0
    #: A lone request's time on the request path, outside engine steps: from its arrival at the
    #: HTTP server (or the gateway in front) into the engine's queue, plus its first token's way
    #: back. Counted in TTFT and end-to-end time, not in step time.
    request_overhead_s: float = 0.0
    #: The request path's own work per request and per streamed token (the API server's
    #: tokenising, detokenising and SSE writes, a gateway's relay). The path serves one job at
    #: a time, so under concurrency these queue behind each other: the part of
    #: ``request_overhead_s`` they do not account for is plain latency. Fitted from bursts of
    #: concurrent requests (``replica/sim/request_path.py`` says how they are served).
    request_work_s: float = 0.0
    stream_token_s: float = 0.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"step_time.{item.name}: must be a number >= 0 (got {value!r})")
        if self.base_s + self.prefill_token_s + self.decode_seq_s <= 0:
            raise ValueError("step_time: base_s, prefill_token_s and decode_seq_s are all 0")

    @classmethod
    def from_mapping(cls, data: Any) -> StepTimeModel:
        """Build from a profile's ``step_time`` mapping; unknown keys are errors."""
        if isinstance(data, StepTimeModel):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"step_time: expected a mapping (got {type(data).__name__})")
        unknown = sorted(set(data) - set(STEP_TIME_FIELDS))
        if unknown:
            raise ValueError(f"step_time.{unknown[0]}: unknown key")
        missing = [n for n in ("base_s", "prefill_token_s", "decode_seq_s") if n not in data]
        if missing:
            raise ValueError(f"step_time.{missing[0]}: required")
        return cls(**{k: float(v) for k, v in data.items()})

    def as_mapping(self) -> dict[str, float]:
        """The profile YAML form."""
        return asdict(self)

    def step_s(self, prefill_tokens: float, decode_seqs: float, context_tokens: float) -> float:
        """One step's modelled duration."""
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def lone_ttft_s(self, prompt_tokens: int, chunk_tokens: int) -> float:
        """A lone request's time to first token: its request path (``request_overhead_s``) and
        its prefill in steps of ``chunk_tokens`` (``--max-num-batched-tokens`` under chunked
        prefill), each reading the KV of the chunks before it, as the simulated engine runs it."""
        total, done = self.request_overhead_s, 0
        chunk_tokens = max(1, chunk_tokens)
        while done < prompt_tokens:
            chunk = min(chunk_tokens, prompt_tokens - done)
            total += self.step_s(chunk, 0, done)
            done += chunk
        return total

    def prefill_tokens_per_s(self) -> float:
        """Marginal prefill throughput of a large chunk (tokens/s); inf if prefill is free."""
        return float("inf") if self.prefill_token_s == 0 else 1.0 / self.prefill_token_s


STEP_TIME_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepTimeModel))
#: The fields the least-squares step fit solves for (the request path's work is fitted apart).
LINEAR_FIELDS: tuple[str, ...] = STEP_TIME_FIELDS[:5]
