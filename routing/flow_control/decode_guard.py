"""Stall budgets of the critical decodes in flight: which new prefill would push one past its TPOT.

A request's TPOT is its decode time over its output tokens. With chunked prefill every prefill
that lands on a replica shares that replica's engine steps with its running decodes, so each of
them waits the prefill out once. A critical request asking for ``n`` tokens can absorb
``(n - 1) × (TPOT SLO - the replica's inter-token latency)`` ms of such stalls and still meet its
TPOT; that is its budget when it is admitted. Every prefill admitted to the same replica
afterwards spends its predicted prefill time from the budget of every critical request there.
A prefill larger than what a budget has left would push that request past its SLO.

Past saturation these stalls, not the mean inter-token latency, were what made critical
requests miss (bench.flow_control: at 4× on the public synthetic trace the inter-token bound was
already at its floor and critical requests still missed their TPOT at 4%).

The budget is counted from what the gateway itself admitted, so it needs no engine counters: the
stalls a prefill queued in the engine before the critical request puts on it are not counted, nor
is how fast its decode actually went. A budget already spent below zero is dropped (that request
has missed anyway, and holding work for it would help no one), and so is one older than its
whole SLO (a finish that was never reported).
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.policies.placements import Placements
from routing.types import ReplicaId

__all__ = ["DecodeGuard"]

#: Protected requests remembered at most (a finish never reported is forgotten, oldest first).
MAX_PROTECTED = 4096


@dataclass(slots=True, eq=False)  # compared by identity: two entries may hold equal figures
class _Protected:
    request_id: str
    budget_ms: float
    #: Controller-clock seconds after which the entry is dropped.
    expires_s: float


class DecodeGuard:
    """The critical decodes in flight per replica, and the stall each can still absorb (ms)."""

    def __init__(self) -> None:
        self._protected: Placements[_Protected] = Placements(MAX_PROTECTED)

    def __len__(self) -> int:
        return len(self._protected)

    def admitted(
        self,
        request_id: str,
        replica: ReplicaId | None,
        prefill_ms: float | None,
        now_s: float,
        *,
        protect: bool = False,
        output_tokens: int | None = None,
        tpot_slo_ms: float | None = None,
        ttft_slo_ms: float = 0.0,
        decode_itl_ms: float | None = None,
    ) -> None:
        """A request was admitted to ``replica`` with a predicted prefill of ``prefill_ms``: it
        spends that from every protected budget there; with ``protect`` it is protected in turn
        (when it asks for at least two tokens and has a TPOT SLO)."""
        if replica is None:
            return
        self._expire(replica, now_s)
        if prefill_ms is not None and prefill_ms > 0:
            for entry in list(self._protected.on(replica)):
                entry.budget_ms -= prefill_ms
                if entry.budget_ms < 0:
                    self._protected.forget(entry.request_id)
        if not protect or output_tokens is None or output_tokens < 2 or tpot_slo_ms is None:
            return
        slack = tpot_slo_ms - (decode_itl_ms or 0.0)
        if slack <= 0:
            return  # its decodes already run at the SLO: nothing to protect
        lifetime_s = (ttft_slo_ms + output_tokens * tpot_slo_ms) / 1000.0
        entry = _Protected(request_id, (output_tokens - 1) * slack, now_s + lifetime_s)
        self._protected.place(request_id, replica, entry)

    def endangers(self, replica: ReplicaId | None, prefill_ms: float | None, now_s: float) -> bool:
        """True when a prefill of ``prefill_ms`` on ``replica`` would spend more than a
        protected decode there has left."""
        if replica is None or prefill_ms is None or prefill_ms <= 0:
            return False
        self._expire(replica, now_s)
        return any(entry.budget_ms < prefill_ms for entry in self._protected.on(replica))

    def finished(self, request_id: str) -> None:
        """The request ended (or needs no protection any more)."""
        self._protected.forget(request_id)

    def _expire(self, replica: ReplicaId, now_s: float) -> None:
        for entry in list(self._protected.on(replica)):
            if entry.expires_s <= now_s:
                self._protected.forget(entry.request_id)
