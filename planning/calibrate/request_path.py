"""The request path's work, fitted from bursts of concurrent requests.

A lone request shows the path only as a constant (``request_overhead_s``). A burst shows its
throughput: ``k`` requests of ``T`` tokens sent together cost the path ``k`` admissions and
``k × T`` deliveries, served one at a time (``replica/sim/request_path.py``). Where that work,
not the engine, is what the burst waits for, the client's makespan (first send to the burst's
last token) is about ``k·request_work + k·T·stream_token``: two burst shapes with different
``T`` separate the two.

The fit, in three moves:

1. Each burst shape is replayed in the engine model with no path work (only the lone
   overhead). Shapes the engine alone explains (measured within ``PATH_BOUND_RATIO`` of that)
   say nothing about the path, beyond that its work is small: with none left, both terms are 0.
2. Least squares on the path-bound shapes' makespans gives the two terms' ratio and size.
3. One scale on both terms, by bisection, makes the engine model with the path replay the
   path-bound shapes' total makespan exactly: engine steps and deliveries overlap, which the
   straight-line formula of step 2 ignores.

A lone request pays its own admission and first delivery, so their sum is capped at the lone
overhead.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replica.sim.engine import EngineConfig, EngineModel, SimRequest
from replica.sim.request_path import RequestPath
from replica.sim.step_time import StepTimeModel

__all__ = [
    "Burst",
    "BurstResidual",
    "PathFit",
    "fit_request_path",
    "lower_quartile",
    "simulate_burst",
]

#: A burst whose makespan exceeds the engine-only replay's by less than this waited on the
#: engine, not on the path.
PATH_BOUND_RATIO = 1.15
#: Bisection steps of the final scale (each halves the interval).
SCALE_STEPS = 20


@dataclass(frozen=True, slots=True)
class Burst:
    """``requests`` fresh prompts sent together, as the client saw them."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    #: First send to the burst's last token.
    makespan_s: float
    mean_ttft_s: float

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.requests, self.prompt_tokens, self.output_tokens

    @property
    def label(self) -> str:
        return f"burst {self.requests} x {self.output_tokens} tokens (makespan)"


@dataclass(frozen=True, slots=True)
class BurstResidual:
    """One burst shape (the lower quartile of its repeats) against the fitted model."""

    burst: Burst
    repeats: int
    #: The engine model's makespan with the fitted path, and with no path work.
    predicted_s: float
    engine_only_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.burst.makespan_s - 1.0

    @property
    def path_bound(self) -> bool:
        return self.burst.makespan_s > PATH_BOUND_RATIO * self.engine_only_s


@dataclass(frozen=True, slots=True)
class PathFit:
    """The step-time model with the request path's work, and how well it replays the bursts."""

    model: StepTimeModel
    residuals: list[BurstResidual]
    #: Every burst measured, repeats included (what the fit started from).
    bursts: list[Burst] = dataclasses.field(default_factory=list)

    def table(self) -> str:
        """The bursts, one line per shape (empty without bursts)."""
        if not self.residuals:
            return ""
        lines = [f"{'burst':<40} {'measured ms':>12} {'fitted ms':>10} {'error':>8}  "
                 "engine alone"]
        for r in self.residuals:
            label = r.burst.label + (
                f" (lower quartile of {r.repeats})" if r.repeats > 1 else ""
            )
            lines.append(
                f"{label:<40} {r.burst.makespan_s * 1e3:>12.1f} {r.predicted_s * 1e3:>10.1f} "
                f"{r.error:>+8.1%}  {r.engine_only_s * 1e3:.1f} ms"
                + ("" if r.path_bound else " (engine-bound: not in the path fit)")
            )
        m = self.model
        lines.append(
            f"request path: {m.request_work_s * 1e3:.3f} ms work per request, "
            f"{m.stream_token_s * 1e3:.3f} ms per streamed token (lone overhead "
            f"{m.request_overhead_s * 1e3:.2f} ms)"
        )
        return "\n".join(lines)


def simulate_burst(config: EngineConfig, requests: int, prompt_tokens: int,
                   output_tokens: int) -> tuple[float, float]:
    """(makespan, mean TTFT) of ``requests`` fresh prompts arriving together at the engine
    model behind ``config``'s request path, in virtual seconds."""
    engine = EngineModel(config)
    path = RequestPath.of(config.step_time)
    admitted_at = [0.0 if path is None else path.admit(0.0) for _ in range(requests)]
    # Distinct token ids per request: nothing of the burst is cached.
    pending = [
        SimRequest(f"burst-{i}", [1 + i * prompt_tokens + j for j in range(prompt_tokens)],
                   output_tokens)
        for i in range(requests)
    ]
    now, nxt = 0.0, 0
    first: dict[str, float] = {}
    finish = 0.0
    while nxt < requests or engine.has_work():
        if not engine.has_work():
            now = max(now, admitted_at[nxt])
        while nxt < requests and admitted_at[nxt] <= now:
            engine.submit(pending[nxt])
            nxt += 1
        result = engine.step(now)
        now += result.duration_s
        delivered = now if path is None else path.deliver(now, sum(result.tokens.values()))
        for request_id in result.first_token:
            first[request_id] = delivered
        if result.finished:
            finish = delivered
    return finish, statistics.fmean(first.values())


def lower_quartile(values: Sequence[float]) -> float:
    """The value a quarter of the way up (the fastest of up to four, the second of five to
    eight): the stall-free repeat, since a stall only ever adds time and the model has none."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def _typical_shapes(bursts: Sequence[Burst]) -> list[tuple[Burst, int]]:
    """One burst per shape, its repeats' lower quartile (``lower_quartile``), and how many
    there were.

    The median let stalls through: on a 2-core machine about a third of the bursts stall, so
    two of three repeats did so about a quarter of the time, and one such shape (a 32 x 32
    burst at 1,327 ms against 240 ms in the run before) set the per-token cost to 0.63 ms
    against 0.09 (session 17).
    """
    groups: dict[tuple[int, int, int], list[Burst]] = {}
    for b in bursts:
        groups.setdefault(b.shape, []).append(b)
    out = []
    for shape, group in groups.items():
        makespan = lower_quartile([b.makespan_s for b in group])
        ttft = lower_quartile([b.mean_ttft_s for b in group])
        out.append((Burst(*shape, makespan, ttft), len(group)))
    return out


def _with_path(config: EngineConfig, step: StepTimeModel) -> EngineConfig:
    return config.with_overrides(step_time=step)


def fit_request_path(config: EngineConfig, bursts: Sequence[Burst]) -> PathFit:
    """The request path's work per request and per token (``config.step_time`` holds the
    fitted step model and lone overhead; its path terms are ignored and refitted)."""
    if config.step_time is None:
        raise ValueError("fit_request_path needs a config with a fitted step_time")
    lone = dataclasses.replace(config.step_time, request_work_s=0.0, stream_token_s=0.0)
    shapes = _typical_shapes(bursts)
    engine_only = [simulate_burst(_with_path(config, lone), *b.shape)[0] for b, _ in shapes]
    bound = [(b, e) for (b, _), e in zip(shapes, engine_only, strict=True)
             if b.makespan_s > PATH_BOUND_RATIO * e]
    work = token = 0.0
    if bound:
        design = np.array([[b.requests, b.requests * b.output_tokens] for b, _ in bound], float)
        target = np.array([b.makespan_s for b, _ in bound])
        weights = 1.0 / target  # relative error: short and long bursts weigh alike
        coef, *_ = np.linalg.lstsq(design * weights[:, None], target * weights, rcond=None)
        if coef[0] < 0 or coef[1] < 0:  # one term unsupported: the other alone
            column = 1 if coef[0] < 0 else 0
            only = design[:, column] * weights
            coef = np.zeros(2)
            coef[column] = max(0.0, float(only @ (target * weights) / (only @ only)))
        work, token = _capped(lone, *(float(c) for c in coef))
        work, token = _capped(lone, *_scaled_to(config, lone, bound, work, token))
    model = dataclasses.replace(lone, request_work_s=work, stream_token_s=token)
    residuals = [
        BurstResidual(b, n, simulate_burst(_with_path(config, model), *b.shape)[0], e)
        for (b, n), e in zip(shapes, engine_only, strict=True)
    ]
    return PathFit(model, residuals, list(bursts))


def _scaled_to(config: EngineConfig, lone: StepTimeModel, bound: Sequence[tuple[Burst, float]],
               work: float, token: float) -> tuple[float, float]:
    """``(work, token)`` scaled by one factor so the model replays the path-bound bursts'
    total makespan (engine steps and deliveries overlap, which the straight-line fit ignores)."""
    if work == 0 and token == 0:
        return work, token
    measured = sum(b.makespan_s for b, _ in bound)

    def total(scale: float) -> float:
        step = dataclasses.replace(lone, request_work_s=work * scale, stream_token_s=token * scale)
        return sum(simulate_burst(_with_path(config, step), *b.shape)[0] for b, _ in bound)

    low, high = 0.0, 1.0
    while total(high) < measured and high < 64:
        low, high = high, high * 2
    for _ in range(SCALE_STEPS):
        middle = (low + high) / 2
        if total(middle) < measured:
            low = middle
        else:
            high = middle
    scale = (low + high) / 2
    return work * scale, token * scale


def _capped(lone: StepTimeModel, work: float, token: float) -> tuple[float, float]:
    """A lone request pays its own admission and first delivery within its measured overhead:
    what bursts ask beyond that is not the path's (the residuals then show the miss)."""
    overhead = lone.request_overhead_s
    if overhead <= 0:
        return work, token
    token = min(token, overhead)
    return min(work, overhead - token), token
