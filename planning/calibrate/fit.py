"""Least-squares fit of the step-time model to designed observations, with residuals.

Two kinds of observation, each a linear function of the unknowns
``(base_s, prefill_token_s, decode_seq_s, context_token_s, request_overhead_s)``:

- a lone request's **TTFT** = request overhead + one step that prefills its uncached tokens
  while reading its cached ones: ``overhead + base + prefill·uncached + context·cached``;
- a decode batch's **decode span** (``B`` requests sent together, ``N`` tokens each; the median
  request's first token to its last) = ``N − 1`` decode steps of ``B`` sequences:
  ``(N−1)·base + decode·(N−1)·B + context·(N−1)·B·ctx``.

Spans over many tokens rather than single gaps between streamed chunks: an API server short of
CPU sends several tokens in one chunk, which ruins single gaps more than long spans. The spans
pin ``base``; the TTFTs then separate the request overhead from it. A coefficient the data
cannot support (a negative estimate) is fixed at 0 and the rest refitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replica.sim.step_time import LINEAR_FIELDS, StepTimeModel

__all__ = ["FitResult", "Observation", "combine_repeats", "fit_step_time"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured time and what the engine did in it."""

    #: ``prefill`` (a lone request's TTFT) or ``decode`` (a decode batch's end-to-end time).
    kind: str
    #: A label for the residual table, e.g. ``prefill 512 (cached 480)``.
    label: str
    measured_s: float
    #: Engine steps in the measured time, and their summed contents.
    steps: float = 1.0
    prefill_tokens: float = 0.0
    decode_seqs: float = 0.0
    context_tokens: float = 0.0
    #: Request overheads in the measured time (1: it starts at the client's send).
    overheads: float = 1.0
    #: Whose clock measured it: ``client`` (the client's view of the stream), or ``engine
    #: clock`` (the engine's own histogram, where the client's view was merged or disagreed).
    clock: str = "client"

    def features(self) -> list[float]:
        """The row of the design matrix, in ``LINEAR_FIELDS`` order."""
        return [self.steps, self.prefill_tokens, self.decode_seqs, self.context_tokens,
                self.overheads]


@dataclass(frozen=True, slots=True)
class Residual:
    """One observation against the fitted model."""

    observation: Observation
    predicted_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction (predicted / measured − 1)."""
        return self.predicted_s / self.observation.measured_s - 1.0


@dataclass(frozen=True, slots=True)
class FitResult:
    """The fitted model and how well it explains each observation."""

    model: StepTimeModel
    residuals: list[Residual]

    @property
    def median_abs_error(self) -> float:
        """Median |relative error| over all observations."""
        return float(np.median([abs(r.error) for r in self.residuals]))

    @property
    def max_abs_error(self) -> float:
        """Largest |relative error|."""
        return max(abs(r.error) for r in self.residuals)

    def table(self) -> str:
        """The residuals, one line per observation."""
        lines = [f"{'observation':<40} {'measured ms':>12} {'fitted ms':>10} {'error':>8}"]
        for r in self.residuals:
            lines.append(
                f"{r.observation.label:<40} {r.observation.measured_s * 1e3:>12.2f} "
                f"{r.predicted_s * 1e3:>10.2f} {r.error:>+8.1%}"
            )
        lines.append(
            f"median |error| {self.median_abs_error:.1%}, max |error| {self.max_abs_error:.1%} "
            f"over {len(self.residuals)} observations"
        )
        return "\n".join(lines)


def combine_repeats(observations: Sequence[Observation]) -> list[Observation]:
    """One observation per distinct step content: the median of its repeats.

    On a shared machine a repeat is sometimes several times slower (another process had the
    CPU); the median of a few repeats ignores such a stall where a mean or a least-squares fit
    over every repeat would chase it.
    """
    groups: dict[tuple[float, ...], list[Observation]] = {}
    for o in observations:
        groups.setdefault(tuple(o.features()), []).append(o)
    combined = []
    for group in groups.values():
        first = group[0]
        label = first.label if len(group) == 1 else f"{first.label} (median of {len(group)})"
        engine_clock = sum(o.clock != "client" for o in group)
        if engine_clock:
            label += f" [engine clock {engine_clock}/{len(group)}]"
        median = float(np.median([o.measured_s for o in group]))
        combined.append(
            Observation(first.kind, label, median, first.steps, first.prefill_tokens,
                        first.decode_seqs, first.context_tokens, first.overheads)
        )
    return combined


def fit_step_time(observations: Sequence[Observation]) -> FitResult:
    """Fit the step-time model to the medians of repeated observations; relative least
    squares, so short and long steps weigh alike."""
    observations = combine_repeats(observations)
    if not any(o.kind == "decode" for o in observations) or not any(
        o.kind == "prefill" for o in observations
    ):
        raise ValueError("calibration needs both prefill and decode observations")
    design = np.array([o.features() for o in observations], dtype=float)
    measured = np.array([o.measured_s for o in observations], dtype=float)
    if np.any(measured <= 0):
        raise ValueError("every measured time must be > 0")
    # Divide each row by its measurement: minimises relative, not absolute, error.
    weights = 1.0 / measured
    free = list(range(design.shape[1]))
    coef = np.zeros(design.shape[1])
    while free:
        sub = design[:, free] * weights[:, None]
        solution, *_ = np.linalg.lstsq(sub, measured * weights, rcond=None)
        if np.all(solution >= 0):
            coef[:] = 0.0
            coef[free] = solution
            break
        # Fix the most negative coefficient at 0 and refit the rest.
        free.pop(int(np.argmin(solution)))
    model = StepTimeModel(**dict(zip(LINEAR_FIELDS, (float(c) for c in coef), strict=True)))
    predicted = design @ coef
    residuals = [Residual(o, float(p)) for o, p in zip(observations, predicted, strict=True)]
    return FitResult(model, residuals)
