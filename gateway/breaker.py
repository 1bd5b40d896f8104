"""A per-replica circuit breaker: stop sending to a replica that keeps failing, probe it later."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens after ``failure_threshold`` consecutive failures; after ``cooldown_s`` lets one probe.

    The probe's outcome closes it again or re-opens it for another cooldown. ``clock`` is
    injectable so tests step time explicitly instead of sleeping.

    A health poll that answers (``health_ok``) closes it only when every failure since the last
    success was the replica being unreachable: a restarted engine is back once its ``/health``
    answers. A replica whose requests time out or fail with a 5xx while ``/health`` still answers
    (a wedged engine behind a live HTTP server) is not cleared by its polls: only a request that
    succeeds, the probe after the cooldown, closes the circuit.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_trip: Callable[[bool], None] | None = None,
    ) -> None:
        self.failure_threshold = failure_threshold
        #: Told True when the circuit opens and False when it closes again: its owner can then
        #: track the few open breakers instead of asking every one on each request.
        self._on_trip = on_trip
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        #: False once a failure since the last success was more than "unreachable".
        self._health_can_clear = True
        self._opened_at: float | None = None
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        """Current state (OPEN turns HALF_OPEN by itself once the cooldown has passed)."""
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        """True if a request may go to this replica now (without reserving the probe)."""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probe_in_flight
        )

    def begin(self) -> None:
        """A request is being sent; in HALF_OPEN it is the single probe."""
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True

    def success(self) -> None:
        """A request succeeded: close the circuit."""
        self._failures = 0
        self._health_can_clear = True
        was_open = self._opened_at is not None
        self._opened_at = None
        self._probe_in_flight = False
        if was_open and self._on_trip is not None:
            self._on_trip(False)

    def health_ok(self) -> None:
        """The replica's ``/health`` answered: clears failures that were only unreachability."""
        if self._health_can_clear:
            self.success()

    def failure(self, unreachable: bool = False) -> None:
        """A request failed (``unreachable``: it never got through, a connect error or a replica
        the health loop took down): count, maybe open."""
        self._failures += 1
        self._health_can_clear = self._health_can_clear and unreachable
        self._probe_in_flight = False
        if self._opened_at is not None or self._failures >= self.failure_threshold:
            opens = self._opened_at is None
            self._opened_at = self._clock()
            if opens and self._on_trip is not None:
                self._on_trip(True)
