"""Hand the latest engine state to a background thread that writes it, throttled.

vLLM calls stat loggers from the API server's asyncio output loop, once per engine step: anything
slow there delays every stream. So ``offer()`` only swaps one reference under a lock, and a daemon
thread does the I/O:

* a one-slot mailbox — a newer snapshot replaces an unwritten older one, since only the newest
  gauge matters and the counters in it are cumulative — so memory is bounded whatever Redis does;
* at most one write per ``min_interval_s``, but the trailing snapshot is always written (an engine
  that goes idle within the interval must not stay "busy" in Redis);
* a heartbeat re-write every ``heartbeat_s`` while nothing changes, so keys with a TTL outlive an
  idle engine and reappear after a Redis outage;
* write failures are counted and logged once per outage (and once on recovery), never raised.

``pump(now)`` holds all timing decisions and takes the clock as an argument, so tests drive it
deterministically; the thread only calls it in a loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from replica.vllm_plugin.log import logger

__all__ = ["StatePublisher", "WriteFn"]

#: Writes one snapshot (hash fields), or only refreshes TTLs/static state when given None.
WriteFn = Callable[[Mapping[str, str] | None], None]


class StatePublisher:
    """A throttled, non-blocking writer of the newest snapshot."""

    def __init__(
        self,
        write: WriteFn,
        min_interval_s: float,
        heartbeat_s: float,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "fleetgate-state",
    ) -> None:
        if not min_interval_s > 0 or not heartbeat_s > 0:
            raise ValueError("min_interval_s and heartbeat_s must be > 0")
        self._write = write
        self._min_interval_s = min_interval_s
        self._heartbeat_s = heartbeat_s
        # After a failure, wait at least this long: hammering a down Redis every 50 ms would only
        # burn the thread on connect timeouts.
        self._retry_s = max(retry_s, min_interval_s)
        self._clock = clock
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: Mapping[str, str] | None = None
        self._last: Mapping[str, str] | None = None
        self._next_allowed = float("-inf")
        self._last_attempt = float("-inf")
        self._failing = False
        self._thread: threading.Thread | None = None
        #: Counters, readable by tests and by whoever logs the plugin's health.
        self.offered = 0
        self.writes = 0
        self.failures = 0

    # -- called on the engine's thread -----------------------------------------------------
    def offer(self, fields: Mapping[str, str]) -> None:
        """Make ``fields`` the snapshot to write next; never blocks on I/O."""
        with self._lock:
            self._pending = fields
            self.offered += 1
        self._wake.set()

    # -- timing logic (deterministic) --------------------------------------------------------
    def pump(self, now: float) -> float:
        """Write if something is due at ``now``; return seconds until the next thing is due."""
        with self._lock:
            pending = self._pending
            allowed = now >= self._next_allowed
            state_due = allowed and pending is not None
            heartbeat_due = allowed and now - self._last_attempt >= self._heartbeat_s
            if state_due:
                self._pending = None
        if state_due:
            self._attempt(pending, now)
        elif heartbeat_due:
            # Re-write the last snapshot (or just the static keys): idempotent, and it repairs
            # whatever an outage or a key expiry lost.
            self._attempt(self._last, now)
        with self._lock:
            has_pending = self._pending is not None
        until_allowed = max(0.0, self._next_allowed - now)
        if has_pending:
            return until_allowed
        return max(until_allowed, self._last_attempt + self._heartbeat_s - now)

    def _attempt(self, fields: Mapping[str, str] | None, now: float) -> None:
        self._last_attempt = now
        try:
            self._write(fields)
        except Exception as exc:  # any client error means "not written"; never reach the engine
            self.failures += 1
            self._next_allowed = now + self._retry_s
            with self._lock:
                # Keep the unwritten snapshot unless the engine has offered a newer one.
                if fields is not None and self._pending is None:
                    self._pending = fields
            if not self._failing:
                self._failing = True
                logger.warning(
                    "%s: writing engine state failed (%s: %s); retrying every %.1fs, "
                    "further failures are counted, not logged",
                    self._name, type(exc).__name__, exc, self._retry_s,
                )
            return
        self.writes += 1
        self._next_allowed = now + self._min_interval_s
        if fields is not None:
            self._last = fields
        if self._failing:
            self._failing = False
            logger.warning(
                "%s: writing engine state works again (%d failed writes so far)",
                self._name, self.failures,
            )

    # -- the thread -------------------------------------------------------------------------
    def start(self) -> StatePublisher:
        """Start the daemon thread (daemon: it must never keep a stopping engine alive)."""
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            # Clear before pumping: an offer() landing during the pump re-sets the event, so
            # the wait below returns at once instead of sleeping on a pending snapshot.
            self._wake.clear()
            try:
                wait_s = self.pump(self._clock())
            except Exception:  # a bug here must not kill the thread silently
                logger.exception("%s: publisher loop error", self._name)
                wait_s = self._retry_s
            self._wake.wait(timeout=wait_s)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Ask the thread to finish and wait up to ``timeout_s`` for it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
