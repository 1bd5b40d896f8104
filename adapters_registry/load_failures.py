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

Tenants stay apart: two refused adapters of the same *party* (the tenants that own them, or the
public catalogue) price the replica out of that party's cold loads only. One tenant's two broken
adapters say nothing about the replica's storage for another tenant's, and would otherwise let one
tenant slow every tenant's cold loads there. Refusals of two different parties' adapters are the
replica's, for everyone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from routing.config import Adapter
from routing.types import ReplicaId

__all__ = ["REPLICA", "LoadFailureSettings", "LoadFailures", "party_of"]

#: The party of failures that are the replica's own (every adapter's loads are avoided).
REPLICA = ""


def party_of(adapter: Adapter | None) -> str:
    """Who ``adapter`` belongs to, for telling one tenant's broken adapters from a replica's
    broken storage: the public catalogue, or its owners (``REPLICA`` when unknown)."""
    if adapter is None:
        return REPLICA
    return "public" if adapter.public else "owners:" + ",".join(sorted(adapter.owners))


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


@dataclass(frozen=True)
class _Refusal:
    party: str
    at: float


class LoadFailures:
    """Failed loads in a row per replica (and per party there), and until when each is avoided.

    ``party`` names who an adapter belongs to (``catalog.adapter_party``); ``REPLICA`` is the
    replica's own failures, which avoid it for every party.
    """

    def __init__(
        self,
        settings: LoadFailureSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or LoadFailureSettings()
        self._clock = clock
        self._in_a_row: dict[tuple[ReplicaId, str], int] = {}
        self._until: dict[tuple[ReplicaId, str], float] = {}
        #: Per replica, the adapters an engine refused there lately: whose, and when.
        self._refused: dict[ReplicaId, dict[str, _Refusal]] = {}
        #: When each adapter's latest load failed, wherever (a load of it that works clears it).
        self._adapter_failed_at: dict[str, float] = {}

    def failed(
        self, replica: ReplicaId, adapter: str, replica_fault: bool, party: str = REPLICA
    ) -> None:
        """A load of ``adapter`` (owned by ``party``) on ``replica`` failed; ``replica_fault``:
        no answer or a 5xx."""
        now = self._clock()
        if replica_fault:
            self._avoid(replica, REPLICA, now)
            return
        # The engine refused this adapter: the adapter's fault, so far.
        self._adapter_failed_at[adapter] = now
        recent = self._refused.setdefault(replica, {})
        recent[adapter] = _Refusal(party, now)
        for name, refusal in list(recent.items()):
            if now - refusal.at > self.settings.window_s:
                del recent[name]
        if len(recent) < 2:
            return  # one adapter failing: its own fault so far
        parties = {refusal.party for refusal in recent.values()}
        self._avoid(replica, REPLICA if len(parties) > 1 else party, now)

    def succeeded(
        self, replica: ReplicaId, adapter: str | None = None, party: str = REPLICA
    ) -> None:
        """A load (of ``adapter``, owned by ``party``) on ``replica`` worked: the replica loads,
        so it is not avoided any more, nor for that party; another party's avoidance there stands
        (its adapters may still be what fails)."""
        if adapter is not None:
            self._adapter_failed_at.pop(adapter, None)
        for key in ((replica, REPLICA), (replica, party)):
            self._in_a_row.pop(key, None)
            self._until.pop(key, None)
        self._refused.pop(replica, None)

    def recently_failed(self, adapter: str) -> bool:
        """True if an engine refused a load of ``adapter`` (a 4xx) within ``window_s`` and none
        has worked since: its requests are failing, so pre-warming must not make room for it
        (``registry.plan``)."""
        at = self._adapter_failed_at.get(adapter)
        return at is not None and self._clock() - at <= self.settings.window_s

    def avoided(self, replica: ReplicaId, party: str = REPLICA) -> bool:
        """True while a cold load on ``replica`` is priced out: for every party (the replica's
        own failures), or for ``party``'s adapters."""
        now = self._clock()
        return any(
            now < self._until.get(key, float("-inf"))
            for key in {(replica, REPLICA), (replica, party)}
        )

    def _avoid(self, replica: ReplicaId, party: str, now: float) -> None:
        key = (replica, party)
        count = self._in_a_row.get(key, 0) + 1
        self._in_a_row[key] = count
        s = self.settings
        self._until[key] = now + min(s.max_s, s.base_s * 2 ** (count - 1))
