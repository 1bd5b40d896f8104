"""``load`` scorer: fewer requests queued or running scores higher.

Min-max scaled over the candidates: the least loaded scores 1, the most loaded 0, all 1 when
loads are equal. Scaling by the candidates (not an absolute capacity) keeps the score meaningful
on any fleet size without a tuning knob.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.policies.base import Plugin, PluginKind
from routing.state import ReplicaState
from routing.types import ReplicaId


class LoadScorer(Plugin):
    """Scores replicas by ``ReplicaState.load``, least loaded highest."""

    type_name: ClassVar[str] = "load"
    kind: ClassVar[PluginKind] = "scorer"

    def score(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> dict[ReplicaId, float]:
        """(max load - load) / (max load - min load) per replica; 1.0 when all are equal."""
        if not replicas:
            return {}
        loads = {r.replica_id: r.load for r in replicas}
        low, high = min(loads.values()), max(loads.values())
        if high == low:
            return dict.fromkeys(loads, 1.0)
        return {rid: (high - load) / (high - low) for rid, load in loads.items()}
