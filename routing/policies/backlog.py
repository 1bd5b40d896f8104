"""Prefill backlog that drains with time: what a replica still has to prefill, not what it was sent.

The gateway's in-flight counter (``ReplicaState.inflight_prefill_tokens``) drops a request's
uncached tokens only when its first token arrives, so a replica 90% through a 6,000-token prefill
counts as busy as one that has just been handed it. This tracker keeps, per replica, the tokens
this policy dispatched there and drains them at the replica's prefill speed as time passes — a
fluid model of a single FIFO server: ``remaining = max(0, remaining − speed × elapsed)``.

The gateway counter stays the authority on the upper side: once it says a replica has nothing
left to prefill (every first token arrived), the drained estimate is clamped to it, so an engine
faster than estimated never leaves phantom work behind.
"""

from __future__ import annotations

import math

from routing.types import ReplicaId

__all__ = ["DrainingBacklog", "RecentPrefill"]


class DrainingBacklog:
    """Per replica: uncached prompt tokens dispatched and not yet drained at the prefill speed."""

    def __init__(self) -> None:
        #: replica -> [remaining tokens, time drained to (monotonic s), last drain speed].
        self._work: dict[ReplicaId, list[float]] = {}

    def add(self, replica: ReplicaId, tokens: float, now: float) -> None:
        """``tokens`` of prefill work were sent to ``replica`` at ``now``."""
        if tokens <= 0:
            return
        entry = self._work.get(replica)
        if entry is None:
            self._work[replica] = [float(tokens), now, 0.0]
            return
        # Drain the older work up to now first, so the new tokens are not drained for time
        # that passed before they arrived.
        elapsed = now - entry[1]
        if elapsed > 0:
            entry[0] = max(0.0, entry[0] - entry[2] * elapsed)
            entry[1] = now
        entry[0] += tokens

    def remaining(self, replica: ReplicaId, now: float, tokens_per_s: float, upper: float) -> float:
        """Tokens still to prefill on ``replica`` at ``now``, at most ``upper`` (gateway count).

        Drains the stored work to ``now`` at ``tokens_per_s`` (a clock that went backwards drains
        nothing) and clamps it to ``upper``. A replica this tracker never sent work to keeps
        ``upper``: that backlog came from elsewhere and has no dispatch time to age from.
        """
        entry = self._work.get(replica)
        if entry is None:
            return upper  # nothing sent from here: the counter's work is not ours to age
        elapsed = now - entry[1]
        left = entry[0]
        if elapsed > 0:
            left -= tokens_per_s * elapsed
            entry[1] = now
        entry[2] = tokens_per_s
        if left > upper:
            left = upper
        if left < 0.0:
            left = 0.0
        entry[0] = left
        return left


class RecentPrefill:
    """Per replica: prefill work dispatched recently, decayed with time constant ``window_s``.

    The running decodes of a replica stall for every prefill chunk scheduled with them, so their
    TPOT follows the replica's prefill *duty cycle* over their lifetime (seconds), not the backlog
    of this instant. Two replicas with equal backlog now may have prefilled very different amounts
    in the last few seconds; this is that amount, in ms of prefill.
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        #: replica -> [decayed prefill ms, time it was decayed to (monotonic s)].
        self._load: dict[ReplicaId, list[float]] = {}

    def _decayed(self, entry: list[float], now: float) -> float:
        elapsed = now - entry[1]
        if elapsed > 0:
            entry[0] *= math.exp(-elapsed / self._window_s)
            entry[1] = now
        return entry[0]

    def add(self, replica: ReplicaId, prefill_ms: float, now: float) -> None:
        """``prefill_ms`` of prefill work was sent to ``replica`` at ``now``."""
        entry = self._load.get(replica)
        if entry is None:
            self._load[replica] = [max(0.0, prefill_ms), now]
            return
        entry[0] = self._decayed(entry, now) + max(0.0, prefill_ms)

    def load_ms(self, replica: ReplicaId, now: float) -> float:
        """Decayed prefill ms sent to ``replica`` as of ``now`` (0 if none)."""
        entry = self._load.get(replica)
        return 0.0 if entry is None else self._decayed(entry, now)
