"""Replicas whose adapter loads fail, priced out of cold loads for a while.

A replica whose loads fail (a missing storage mount, bad object-store credentials, a stuck
loader) still passes its health checks, so nothing else takes it out of a cold load's way: every
new adapter routed there cold paid a failed load (or, hung, the whole load timeout) before its
fallback. After a failure that is the replica's (no answer, a 5xx), or failures of two different
adapters there within ``window_s`` (vLLM answers 400 or 404 for a missing mount as for one bad
adapter: one adapter failing is its own fault, two are the replica's), this gateway charges that
replica ``penalty_ms`` for any adapter it would have to load, for ``base_s`` doubling with each
failure in a row up to ``max_s``; a load that succeeds there ends it. Requests still go there as
a last resort, and adapters already resident there are unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from routing.types import ReplicaId

__all__ = ["LoadFailureSettings", "LoadFailures"]


@dataclass(frozen=True)
class LoadFailureSettings:
    """How long a replica whose loads fail is avoided, and what a cold load there costs then."""

    base_s: float = 10.0
    max_s: float = 300.0
    #: About a load timeout: what a load there may cost the request (then its fallback).
    penalty_ms: float = 60_000.0
    #: Failures of different adapters within this many seconds count as the replica's.
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"window_s: must be > 0 (got {self.window_s})")
        if not (0 < self.base_s <= self.max_s):
            raise ValueError(f"need 0 < base_s <= max_s (got {self.base_s}, {self.max_s})")
        if self.penalty_ms < 0:
            raise ValueError(f"penalty_ms: must be >= 0 (got {self.penalty_ms})")


class LoadFailures:
    """Failed loads in a row per replica, and until when each is avoided."""

    def __init__(
        self,
        settings: LoadFailureSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or LoadFailureSettings()
        self._clock = clock
        self._in_a_row: dict[ReplicaId, int] = {}
        self._until: dict[ReplicaId, float] = {}
        #: Per replica, the adapters whose loads failed there lately, and when.
        self._adapters: dict[ReplicaId, dict[str, float]] = {}
        #: When each adapter's latest load failed, wherever (a load of it that works clears it).
        self._adapter_failed_at: dict[str, float] = {}

    def failed(self, replica: ReplicaId, adapter: str, replica_fault: bool) -> None:
        """A load of ``adapter`` on ``replica`` failed; ``replica_fault``: no answer or a 5xx."""
        now = self._clock()
        if not replica_fault:  # the engine refused this adapter: the adapter's fault, so far
            self._adapter_failed_at[adapter] = now
        recent = self._adapters.setdefault(replica, {})
        recent[adapter] = now
        for name, at in list(recent.items()):
            if now - at > self.settings.window_s:
                del recent[name]
        if not replica_fault and len(recent) < 2:
            return  # one adapter failing: its own fault so far
        count = self._in_a_row.get(replica, 0) + 1
        self._in_a_row[replica] = count
        s = self.settings
        self._until[replica] = self._clock() + min(s.max_s, s.base_s * 2 ** (count - 1))

    def succeeded(self, replica: ReplicaId, adapter: str | None = None) -> None:
        """A load (of ``adapter``) on ``replica`` worked: it is not avoided any more."""
        if adapter is not None:
            self._adapter_failed_at.pop(adapter, None)
        self._in_a_row.pop(replica, None)
        self._until.pop(replica, None)
        self._adapters.pop(replica, None)

    def recently_failed(self, adapter: str) -> bool:
        """True if an engine refused a load of ``adapter`` (a 4xx) within ``window_s`` and none
        has worked since: its requests are failing, so pre-warming must not make room for it
        (``registry.plan``)."""
        at = self._adapter_failed_at.get(adapter)
        return at is not None and self._clock() - at <= self.settings.window_s

    def avoided(self, replica: ReplicaId) -> bool:
        """True while a cold load on ``replica`` is priced out."""
        until = self._until.get(replica)
        return until is not None and self._clock() < until
