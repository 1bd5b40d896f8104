"""Least-squares fit of the step-time model to designed observations, with residuals.

Two kinds of observation, each a linear function of the unknowns
``(base_s, prefill_token_s, decode_seq_s, context_token_s, request_overhead_s)``:

- a lone request's **TTFT** = request overhead + one step that prefills its uncached tokens
  while reading its cached ones: ``overhead + base + prefill·uncached + context·cached``;
- a batch's **mean inter-token gap** = one decode step of ``B`` sequences reading their
  average context: ``base + decode·B + context·(B × mean context)``.

Decode gaps pin ``base``; TTFTs then separate the request overhead from it. A coefficient the
data cannot support (a negative estimate) is fixed at 0 and the rest refitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replica.sim.step_time import STEP_TIME_FIELDS, StepTimeModel

__all__ = ["FitResult", "Observation", "combine_repeats", "fit_step_time"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured time and what the engine did in it."""

    #: ``prefill`` (a lone request's TTFT) or ``decode`` (a batch's mean inter-token gap).
    kind: str
    #: A label for the residual table, e.g. ``prefill 512 (cached 480)``.
    label: str
    measured_s: float
    prefill_tokens: float = 0.0
    decode_seqs: float = 0.0
    context_tokens: float = 0.0

    def features(self) -> list[float]:
        """The row of the design matrix, in ``STEP_TIME_FIELDS`` order."""
        overhead = 1.0 if self.kind == "prefill" else 0.0
        return [1.0, self.prefill_tokens, self.decode_seqs, self.context_tokens, overhead]


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
    groups: dict[tuple[str, float, float, float], list[Observation]] = {}
    for o in observations:
        key = (o.kind, o.prefill_tokens, o.decode_seqs, o.context_tokens)
        groups.setdefault(key, []).append(o)
    combined = []
    for group in groups.values():
        first = group[0]
        label = first.label if len(group) == 1 else f"{first.label} (median of {len(group)})"
        median = float(np.median([o.measured_s for o in group]))
        combined.append(
            Observation(first.kind, label, median, first.prefill_tokens, first.decode_seqs,
                        first.context_tokens)
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
    model = StepTimeModel(**dict(zip(STEP_TIME_FIELDS, (float(c) for c in coef), strict=True)))
    predicted = design @ coef
    residuals = [Residual(o, float(p)) for o, p in zip(observations, predicted, strict=True)]
    return FitResult(model, residuals)
