"""The fleet as flow control sees it: the routing estimate of one decision, condensed.

Flow control judges by the same numbers routing chose by: the chosen replica's expected TTFT and,
per candidate, its predicted queue wait and decode interference (the stall its recent prefill
work puts on its running decodes, which they pay in TPOT): ``expected-ttft`` / ``fleet-cost``
cost terms. A policy that reports no such terms gives no estimate, and flow control then never
holds or sheds.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.contracts import RoutingDecision

__all__ = ["FleetEstimate", "ReplicaLoad", "estimate_from_decision"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One candidate's predicted queue wait and decode interference (ms)."""

    queue_wait_ms: float
    decode_interference_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class FleetEstimate:
    """Predicted TTFT of the chosen replica and every candidate's load (ms)."""

    #: ``None``: the routing policy estimates no TTFT (flow control cannot judge).
    predicted_ttft_ms: float | None
    #: Per candidate; empty when the policy estimates no queue wait.
    loads: tuple[ReplicaLoad, ...] = ()

    @property
    def min_queue_wait_ms(self) -> float | None:
        """The least-loaded candidate's predicted queue wait (None: unknown)."""
        return min(load.queue_wait_ms for load in self.loads) if self.loads else None

    @classmethod
    def unknown(cls) -> FleetEstimate:
        """No estimate: flow control admits."""
        return cls(None, ())


def estimate_from_decision(decision: RoutingDecision) -> FleetEstimate:
    """The estimate behind ``decision``: its chosen replica's TTFT, every candidate's load."""
    loads = []
    for explanation in decision.explanations.values():
        if explanation.filtered_out_by is not None:
            continue
        terms = explanation.terms
        wait = terms.get("queue_wait_ms")
        if wait is not None:
            loads.append(ReplicaLoad(wait, terms.get("decode_interference_ms", 0.0)))
    chosen = decision.explanations.get(decision.replica)
    ttft = chosen.terms.get("expected_ttft_ms") if chosen is not None else None
    return FleetEstimate(ttft, tuple(loads))
