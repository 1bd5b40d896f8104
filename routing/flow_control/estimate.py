"""The fleet as flow control sees it: the routing estimate of one decision, and what each engine
reports about its own queue.

Two kinds of numbers, for two questions:

* **Is the fleet saturated?** Judged per candidate from what its engine reports (vLLM's
  ``num_requests_waiting``, ``kv_cache_usage_perc`` and the recent mean of its
  ``inter_token_latency_seconds``) and what this gateway knows fresher than the last poll
  (requests it sent that the engine was not yet running). Requests waiting only for a GPU
  LoRA slot (``ReplicaState.waiting_only_for_slots``) are no backlog: they hold no engine
  capacity, vLLM runs others ahead of them, and holding more at the gateway frees no slot
  sooner (measured on b2b-lora: docs/flow-control.md). A predicted queue wait is a model of
  the engine's queue and undercounts or overcounts it depending on the workload; the engine's
  own waiting queue is the fact that the model predicts.
* **Would this request meet its SLO?** The chosen replica's expected TTFT
  (``expected-ttft`` / ``fleet-cost`` cost terms), and per candidate the predicted queue wait and
  decode interference (the stall its recent prefill work puts on its running decodes).

A policy that reports no TTFT terms gives no estimate, and flow control then never holds or sheds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from routing.contracts import RoutingDecision
from routing.state import ReplicaState
from routing.types import ReplicaId

__all__ = ["FleetEstimate", "ReplicaLoad", "estimate_from_decision"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One candidate: predicted queue wait and decode interference (ms), and its engine's queue."""

    queue_wait_ms: float
    decode_interference_ms: float = 0.0
    #: Requests waiting to start there: the engine's waiting queue, or, when larger, this
    #: gateway's in-flight requests beyond what the engine last reported running (sent since
    #: the last poll). None: the engine's figures are unknown.
    backlog_requests: int | None = None
    #: Fraction of its KV cache in use, 0..1 (None: unknown).
    kv_usage: float | None = None
    #: Mean time between output tokens there lately (ms; None: unknown or nothing decoding).
    decode_itl_ms: float | None = None
    #: Which replica (None: unknown).
    replica: ReplicaId | None = None
    #: Requests running there now, as its engine last reported them less those that ended
    #: since (None: unknown).
    running_requests: int | None = None

    @property
    def idle(self) -> bool:
        """Known to run nothing and have nothing waiting: a prefill there slows no decode."""
        return self.running_requests == 0 and self.backlog_requests == 0


@dataclass(frozen=True, slots=True)
class FleetEstimate:
    """Predicted TTFT of the chosen replica and every candidate's load."""

    #: ``None``: the routing policy estimates no TTFT (flow control cannot judge).
    predicted_ttft_ms: float | None
    #: Per candidate; empty when the policy estimates no queue wait.
    loads: tuple[ReplicaLoad, ...] = ()
    #: The chosen replica's recent inter-token latency (ms; None: unknown).
    chosen_decode_itl_ms: float | None = None
    #: The replica routing chose (None: unknown) ...
    chosen_replica: ReplicaId | None = None
    #: ... and the request's predicted prefill time there (ms; None: unknown).
    chosen_prefill_ms: float | None = None

    @property
    def min_queue_wait_ms(self) -> float | None:
        """The least-loaded candidate's predicted queue wait (None: unknown)."""
        return min(load.queue_wait_ms for load in self.loads) if self.loads else None

    @classmethod
    def unknown(cls) -> FleetEstimate:
        """No estimate: flow control admits."""
        return cls(None, ())


def estimate_from_decision(
    decision: RoutingDecision, states: Iterable[ReplicaState] = ()
) -> FleetEstimate:
    """The estimate behind ``decision``: its chosen replica's TTFT, every candidate's load, and,
    for candidates in ``states``, their engines' queue and KV usage."""
    explanations = decision.explanations
    # The scored replicas only: the others were filtered out or pruned (and a large fleet's
    # thousand explanations would cost milliseconds to build).
    only_scored = getattr(explanations, "scored", None)  # the engine's ExplanationMap
    scored = only_scored() if only_scored is not None else explanations.items()
    by_id = {state.replica_id: state for state in states}
    loads = []
    for replica, explanation in scored:
        if explanation.filtered_out_by is not None:
            continue
        terms = explanation.terms
        wait = terms.get("queue_wait_ms")
        if wait is None:
            continue
        state = by_id.get(replica)
        backlog = None
        if state is not None:
            backlog = state.queued
            if state.waiting_only_for_slots:
                # Requests waiting for an adapter slot hold no engine capacity, and holding
                # more at the gateway frees no slot sooner: they are not a backlog.
                backlog = 0
        loads.append(
            ReplicaLoad(
                wait,
                terms.get("decode_interference_ms", 0.0),
                backlog,
                state.kv_usage_now if state is not None else None,
                _decoding_itl(state),
                replica,
                state.running_now if state is not None else None,
            )
        )
    chosen = decision.explanations.get(decision.replica)
    ttft = chosen.terms.get("expected_ttft_ms") if chosen is not None else None
    prefill = chosen.terms.get("prefill_ms") if chosen is not None else None
    chosen_state = by_id.get(decision.replica)
    chosen_itl = _decoding_itl(chosen_state)
    return FleetEstimate(ttft, tuple(loads), chosen_itl, decision.replica, prefill)


def _decoding_itl(state: ReplicaState | None) -> float | None:
    """The replica's recent inter-token latency while something runs there; None when nothing
    does. The engine's figure is a mean over its last few seconds: a replica whose decodes have
    all ended keeps it for up to that long, and a slow pace there held requests at the gateway
    for ~3 s after the replica had gone idle (the streaming review). Nothing running decodes
    slowly."""
    if state is None or state.running_now <= 0:
        return None
    return state.decode_itl_ms
