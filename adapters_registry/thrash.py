"""The thrash guard: at most ``max_loads`` adapter loads per replica per ``window_s``.

A replica that keeps swapping adapters spends its time loading instead of serving, and every
swap evicts an adapter that someone else is about to need. Past the limit, routing sees a large
cold-load penalty for that replica and the loader refuses (``ThrashGuardTripped``) unless no other
replica could serve the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ThrashSettings:
    """Limits of the thrash guard."""

    max_loads: int = 20
    window_s: float = 60.0
    #: Cold-load cost (ms) reported for a non-resident adapter on a tripped replica.
    penalty_ms: float = 600_000.0

    def __post_init__(self) -> None:
        if self.max_loads < 1:
            raise ValueError(f"max_loads: must be >= 1 (got {self.max_loads})")
        if self.window_s <= 0:
            raise ValueError(f"window_s: must be > 0 (got {self.window_s})")
        if self.penalty_ms < 0:
            raise ValueError(f"penalty_ms: must be >= 0 (got {self.penalty_ms})")


class ThrashGuard:
    """Decides from a replica's recent load times; holds no state of its own."""

    def __init__(self, settings: ThrashSettings | None = None) -> None:
        self.settings = settings or ThrashSettings()

    def since(self, now: float) -> float:
        """Start of the window ending at ``now``."""
        return now - self.settings.window_s

    def loads_in_window(self, load_times: Sequence[float], now: float) -> int:
        """Loads within the window ending at ``now``."""
        start = self.since(now)
        return sum(1 for t in load_times if start < t <= now)

    def tripped(self, load_times: Sequence[float], now: float) -> bool:
        """True if one more load would exceed the limit."""
        return self.loads_in_window(load_times, now) >= self.settings.max_loads
