"""``max-score`` picker: the highest weighted score, under a bounded-load guard, shared on ties.

Composes with any scorers. Two guards stop a hot shared prefix (every request scoring best on the
one replica that caches it) from piling onto one replica:

* bounded load: a replica whose load exceeds ``(1 + load_epsilon) * mean + load_slack`` is not
  eligible (the minimum load never exceeds the mean, so someone always is). With
  ``spare_cached_queues`` it stays eligible while the prompt tokens it has yet to prefill are at
  most the fleet's mean: a queue of cache hits is many requests but little work;
* shared ties: among eligible replicas whose score is within ``tie_tolerance`` (relative) of the
  best, the one this picker chose least recently wins (``tie_break: least-recent``, the default;
  never-chosen ones first, in random order), so near-equal replicas take turns.
  ``tie_break: random`` draws uniformly instead.

Why take turns rather than draw: a tie is usually a request nobody has cached, sent while the
replicas look alike (idle, or between two engine scrapes). A uniform draw puts 6 or more of 8 new
prefixes on one of two replicas 29% of the time, overflowing its cache while the other's stays
half empty (the real-vLLM prefix test saw exactly that); turns spread them 4 and 4, and spread a
hot prefix's requests evenly over the replicas that hold it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

from pydantic import Field

from routing.contracts import RoutingRequest
from routing.engine import PluginTerms
from routing.policies.base import ExplainingPicker, PluginKind, PluginParams
from routing.state import ReplicaState
from routing.types import ReplicaId


class MaxScorePicker(ExplainingPicker):
    """Best weighted score among replicas under the load bound; ties taken in turns (least
    recently chosen first) by default, or drawn at random."""

    type_name: ClassVar[str] = "max-score"
    kind: ClassVar[PluginKind] = "picker"
    #: The load guard's mean comes from ``request.candidates`` when the engine pruned.
    prunable: ClassVar[bool] = True

    class Params(PluginParams):
        """Parameters of ``max-score``."""

        #: Relative overload allowed above the mean load before a replica is passed over.
        load_epsilon: float = Field(default=0.25, ge=0.0, le=100.0)
        #: Absolute slack (requests) on top, so small fleets at low load are not over-constrained.
        load_slack: float = Field(default=2.0, ge=0.0)
        #: Scores within this fraction of the best count as a tie, in [0, 1).
        tie_tolerance: float = Field(default=0.05, ge=0.0, lt=1.0)
        #: How a tie is broken: the replica chosen least recently, or a uniform draw.
        tie_break: Literal["least-recent", "random"] = "least-recent"
        #: Keep a replica over the load bound eligible while the prompt tokens it has yet to
        #: prefill are at most the fleet's mean: its queue is of requests that hit its cache,
        #: which cost it little, and passing it over would prefill their prefix again elsewhere.
        spare_cached_queues: bool = False
        #: Keep a replica over the load bound eligible for a request whose LoRA adapter its
        #: running requests use: there the request shares a GPU LoRA slot its adapter already
        #: holds; anywhere else it takes one of the few slots (or waits for one), and the scorer
        #: prices that wait, not the bound.
        spare_adapter_holders: bool = False

    params: Params

    def __init__(self, params: PluginParams | None = None, *, name: str | None = None) -> None:
        super().__init__(params, name=name)
        #: Replica -> sequence number of the last decision that chose it.
        self._last_chosen: dict[ReplicaId, int] = {}
        self._decisions = itertools.count()

    def pick_with_terms(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> tuple[list[ReplicaId], PluginTerms]:
        """``pick`` plus, per replica, whether the load bound made it ineligible."""
        if not replicas:
            return [], {}
        p = self.params
        rng = self.rng(request)
        loads = {r.replica_id: r.load for r in replicas}  # ``load`` is a property: read it once
        fleet = request.candidates
        mean = fleet.mean_load if fleet is not None else sum(loads.values()) / len(loads)
        # An overflow request goes where its scorer sent it: concentrating it is the point.
        bound = math.inf if request.overflow else (1.0 + p.load_epsilon) * mean + p.load_slack
        score_of = scores.get
        draw = rng.random
        # Ids sorted before drawing tie-breakers, so a fixed seed gives a fixed order whatever
        # the input order; then best score first, random among equal scores.
        ranked = sorted([(-score_of(rid, 0.0), draw(), rid) for rid in sorted(loads)])
        spared: set[ReplicaId] = set()
        if p.spare_cached_queues:
            pending = {r.replica_id: r.inflight_prefill_tokens for r in replicas}
            mean_pending = sum(pending.values()) / len(pending)
            spared = {rid for rid, tokens in pending.items() if tokens <= mean_pending}
        if p.spare_adapter_holders and request.adapter:
            spared.update(r.replica_id for r in replicas if request.adapter in r.running_adapters)
        eligible: list[ReplicaId] = []
        over: list[ReplicaId] = []
        for _, _, rid in ranked:
            (eligible if loads[rid] <= bound or rid in spared else over).append(rid)

        best = score_of(eligible[0], 0.0)
        floor = best - p.tie_tolerance * abs(best)
        near = [rid for rid in eligible if score_of(rid, 0.0) >= floor]
        # One candidate needs no draw (the seeded choice is the same either way).
        if len(near) == 1:
            chosen = near[0]
        elif p.tie_break == "random":
            chosen = near[rng.randrange(len(near))]
        else:
            # ``near`` is in ranked order (score, then the random draw): min keeps the first of
            # the never-chosen, so those are taken in random order.
            last = self._last_chosen.get
            chosen = min(near, key=lambda rid: last(rid, -1))
        self._last_chosen[chosen] = next(self._decisions)
        if chosen == eligible[0]:
            order = eligible + over  # the best ranked was chosen: the ranking is the order
        else:
            order = [chosen, *(rid for rid in eligible if rid != chosen), *over]
        terms: dict[ReplicaId, dict[str, float]] = {
            rid: {"over_load_bound": 1.0 if load > bound and rid not in spared else 0.0}
            for rid, load in loads.items()
        }
        return order, terms
