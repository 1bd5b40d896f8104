"""Arrival processes: when requests arrive, independent of what they contain.

- ``poisson``: exponential inter-arrival times at a constant rate (memoryless, the textbook
  assumption behind Erlang-C sizing).
- ``bursty``: an on/off Markov-modulated Poisson process (MMPP). The source alternates between
  an ON state (rate ``peak`` × mean) and an OFF state (the rate that keeps the long-run mean at
  ``rate``), with exponentially distributed state durations. Real chat traffic looks like this:
  the mean is the same as Poisson but queues build during bursts, which is what breaks capacity
  planned from averages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ARRIVALS = ("poisson", "bursty")


@dataclass(frozen=True, slots=True)
class BurstParams:
    """Shape of the on/off process: ON rate = ``peak`` × mean rate for ``on_fraction`` of the time.

    ``cycle_s`` is the mean length of one ON + OFF cycle.
    """

    peak: float = 3.0
    on_fraction: float = 0.25
    cycle_s: float = 40.0

    def __post_init__(self) -> None:
        if self.peak < 1:
            raise ValueError(f"burst peak must be >= 1 (got {self.peak})")
        if not 0 < self.on_fraction < 1:
            raise ValueError(f"burst on_fraction must be in (0, 1) (got {self.on_fraction})")
        if self.peak * self.on_fraction > 1:
            # The ON state alone would already carry more than the mean rate.
            raise ValueError(
                f"burst peak × on_fraction must be <= 1 (got peak {self.peak} × "
                f"on_fraction {self.on_fraction} = {self.peak * self.on_fraction:g})"
            )
        if self.cycle_s <= 0:
            raise ValueError(f"burst cycle_s must be > 0 (got {self.cycle_s})")

    def rates(self, mean_rate: float) -> tuple[float, float]:
        """(ON rate, OFF rate) in requests/s that average to ``mean_rate``."""
        on_rate = self.peak * mean_rate
        off_rate = mean_rate * (1 - self.peak * self.on_fraction) / (1 - self.on_fraction)
        return on_rate, off_rate


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """``count`` arrival times in seconds from a Poisson process of ``rate`` requests/s."""
    _check(count, rate)
    now, times = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def bursty_arrivals(
    count: int, rate: float, rng: random.Random, params: BurstParams | None = None
) -> list[float]:
    """``count`` arrival times in seconds from an on/off MMPP with long-run mean ``rate``."""
    _check(count, rate)
    params = params or BurstParams()
    on_rate, off_rate = params.rates(rate)
    mean_on_s = params.cycle_s * params.on_fraction
    mean_off_s = params.cycle_s - mean_on_s
    now, times = 0.0, []
    on = rng.random() < params.on_fraction  # start in the stationary distribution
    state_end = now + rng.expovariate(1 / (mean_on_s if on else mean_off_s))
    while len(times) < count:
        state_rate = on_rate if on else off_rate
        gap = rng.expovariate(state_rate) if state_rate > 0 else float("inf")
        if now + gap <= state_end:
            now += gap
            times.append(now)
            continue
        # No arrival before the state flips; by memorylessness we may redraw in the new state.
        now = state_end
        on = not on
        state_end = now + rng.expovariate(1 / (mean_on_s if on else mean_off_s))
    return times


def arrivals(
    kind: str,
    count: int,
    rate: float,
    rng: random.Random,
    burst: BurstParams | None = None,
) -> list[float]:
    """Arrival times in seconds for ``kind`` in ``ARRIVALS``."""
    if kind == "poisson":
        return poisson_arrivals(count, rate, rng)
    if kind == "bursty":
        return bursty_arrivals(count, rate, rng, burst)
    raise ValueError(f"unknown arrival process {kind!r}; choose from: {', '.join(ARRIVALS)}")


def _check(count: int, rate: float) -> None:
    if count < 1:
        raise ValueError(f"requests must be >= 1 (got {count})")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (got {rate})")
