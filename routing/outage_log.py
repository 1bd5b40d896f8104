"""Logging a lasting outage once, not once per retry.

A background loop that retries a dependency every second or two (the index mirror's tail,
the adapter registry's refresh) logged a warning per attempt for as long as the outage lasted:
a wrong Redis password filled the log every second, for good. ``OutageLog`` says when to log
the failure (its first, then at most every ``interval_s``, with the count so far) and whether
the outage that ends now was logged, so its end is said once too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OutageLog"]


@dataclass
class OutageLog:
    """The state of one dependency's outage, as far as logging it goes."""

    #: How often a lasting outage is logged again (s).
    interval_s: float = 60.0
    #: Failures since the outage began.
    failures: int = 0
    logged_at: float | None = None

    def failed(self, now: float) -> bool:
        """Count a failure at ``now``; True when it is to be logged."""
        self.failures += 1
        if self.logged_at is None or now - self.logged_at >= self.interval_s:
            self.logged_at = now
            return True
        return False

    def recovered(self) -> int | None:
        """The dependency answers: the failures of a logged outage it ends (to say so), else
        None; either way the count starts afresh."""
        ended = self.failures if self.logged_at is not None else None
        self.failures, self.logged_at = 0, None
        return ended
