"""The engine's recent inter-token latency, from its cumulative histogram.

vLLM exports ``vllm:inter_token_latency_seconds`` as a histogram: a running ``_sum`` and
``_count`` over every output token after a request's first. Each read adds a point; the mean
over the last ``window_s`` is (sum now - sum then) / (count now - count then), the time between
tokens that the replica's streams are living through now. It is a measurement, not a model: when
prefill work crowds a replica's steps, its decodes slow down, and this shows it within a window
whatever the cause (long prompts, preemptions, adapter loads, other gateways' traffic).
"""

from __future__ import annotations

from collections import deque

__all__ = ["RecentItl"]


class RecentItl:
    """Mean inter-token latency over a trailing window of cumulative readings."""

    def __init__(self, window_s: float = 2.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s: must be > 0 (got {window_s!r})")
        self.window_s = window_s
        #: (time, cumulative seconds, cumulative tokens), oldest first.
        self._readings: deque[tuple[float, float, float]] = deque()

    def observe(self, now_s: float, sum_s: float, count: float) -> float | None:
        """Add a reading; returns the window's mean ITL in ms (None: no tokens in the window).

        A counter that went backwards (the engine restarted) starts the window afresh.
        """
        readings = self._readings
        if readings and (count < readings[-1][2] or sum_s < readings[-1][1]):
            readings.clear()
        readings.append((now_s, sum_s, count))
        # Keep the newest reading at or before the window's start as the baseline.
        horizon = now_s - self.window_s
        while len(readings) > 2 and readings[1][0] <= horizon:
            readings.popleft()
        return self.mean_ms()

    def mean_ms(self) -> float | None:
        """The mean over the window as last observed (None: no tokens in it)."""
        readings = self._readings
        if len(readings) < 2:
            return None
        _, first_sum, first_count = readings[0]
        _, last_sum, last_count = readings[-1]
        tokens = last_count - first_count
        if tokens <= 0:
            return None
        return (last_sum - first_sum) / tokens * 1000.0
