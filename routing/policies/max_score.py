"""``max-score`` picker: the highest weighted score, under a bounded-load guard, random on ties.

Composes with any scorers. Two guards stop a hot shared prefix (every request scoring best on the
one replica that caches it) from piling onto one replica:

* bounded load: a replica whose load exceeds ``(1 + load_epsilon) * mean + load_slack`` is not
  eligible (the minimum load never exceeds the mean, so someone always is);
* randomised ties: the choice is uniform among eligible replicas whose score is within
  ``tie_tolerance`` (relative) of the best, so near-equal replicas share the traffic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import Field

from routing.contracts import RoutingRequest
from routing.engine import PluginTerms
from routing.policies.base import ExplainingPicker, PluginKind, PluginParams
from routing.state import ReplicaState
from routing.types import ReplicaId


class MaxScorePicker(ExplainingPicker):
    """Best weighted score among replicas under the load bound; ties broken at random."""

    type_name: ClassVar[str] = "max-score"
    kind: ClassVar[PluginKind] = "picker"

    class Params(PluginParams):
        """Parameters of ``max-score``."""

        #: Relative overload allowed above the mean load before a replica is passed over.
        load_epsilon: float = Field(default=0.25, ge=0.0, le=100.0)
        #: Absolute slack (requests) on top, so small fleets at low load are not over-constrained.
        load_slack: float = Field(default=2.0, ge=0.0)
        #: Scores within this fraction of the best count as a tie, in [0, 1).
        tie_tolerance: float = Field(default=0.05, ge=0.0, lt=1.0)

    params: Params

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
        mean = sum(loads.values()) / len(loads)
        bound = (1.0 + p.load_epsilon) * mean + p.load_slack
        score_of = scores.get
        draw = rng.random
        # Ids sorted before drawing tie-breakers, so a fixed seed gives a fixed order whatever
        # the input order; then best score first, random among equal scores.
        ranked = sorted([(-score_of(rid, 0.0), draw(), rid) for rid in sorted(loads)])
        eligible: list[ReplicaId] = []
        over: list[ReplicaId] = []
        for _, _, rid in ranked:
            (eligible if loads[rid] <= bound else over).append(rid)

        best = score_of(eligible[0], 0.0)
        floor = best - p.tie_tolerance * abs(best)
        near = [rid for rid in eligible if score_of(rid, 0.0) >= floor]
        # One candidate needs no draw (the seeded choice is the same either way).
        chosen = near[rng.randrange(len(near))] if len(near) > 1 else near[0]
        if chosen == eligible[0]:
            order = eligible + over  # the best ranked was chosen: the ranking is the order
        else:
            order = [chosen, *(rid for rid in eligible if rid != chosen), *over]
        terms: dict[ReplicaId, dict[str, float]] = {
            rid: {"over_load_bound": 1.0 if load > bound else 0.0} for rid, load in loads.items()
        }
        return order, terms
