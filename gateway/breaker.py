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

    A health poll that answers (``health_ok``) closes it early, and resets the count, when every
    failure since the last success was a connection refused or dropped (``health_clears``): an
    engine that was killed is back once its ``/health`` answers. Not after a timeout or a 5xx
    answer: an engine wedged behind a live HTTP server (it answers ``/health``, never a request,
    or only with 500s) would otherwise be reopened by every poll and keep its share of traffic,
    each request of it waiting out the timeout or failing. Only a request that succeeds, the
    probe after the cooldown, closes the circuit then.
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
        #: False once a failure since the last success was one a poll cannot clear.
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
        """The replica's ``/health`` answered: clears failures that were connections refused or
        dropped (see the class docstring)."""
        if self._health_can_clear:
            self.success()

    def failure(self, health_clears: bool = False, *, refused: bool = False) -> None:
        """A request failed: count, maybe open. ``health_clears``: the connection was refused or
        dropped (a killed engine), which an answering health poll clears; a timeout or a 5xx
        answer (the engine took the request and failed it) it does not.

        ``refused`` (the connection was refused: nothing listens there) opens the circuit at
        once: the next requests would be refused too, and each would pay a retry until the
        threshold or the next health poll. The poll that answers again closes it
        (``health_ok``), as for any failure a poll clears.
        """
        self._failures += 1
        self._health_can_clear = self._health_can_clear and (health_clears or refused)
        self._probe_in_flight = False
        if (
            self._opened_at is not None
            or refused
            or self._failures >= self.failure_threshold
        ):
            opens = self._opened_at is None
            self._opened_at = self._clock()
            if opens and self._on_trip is not None:
                self._on_trip(True)
