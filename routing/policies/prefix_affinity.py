"""``prefix-affinity`` scorer: the share of the prompt's blocks a replica already caches.

Score = matched blocks / blocks in the prompt chain, from the block index (1.0: the whole prompt
is cached there). With no index data (degraded) or no full block, every replica scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.policies.base import Plugin, PluginKind
from routing.state import ReplicaState
from routing.types import ReplicaId


class PrefixAffinityScorer(Plugin):
    """Scores replicas by the fraction of the prompt chain they hold."""

    type_name: ClassVar[str] = "prefix-affinity"
    kind: ClassVar[PluginKind] = "scorer"
    needs_prefix: ClassVar[bool] = True

    def score(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> dict[ReplicaId, float]:
        """Matched blocks / chain length per replica, in [0, 1]."""
        matches = request.prefix_matches
        blocks = len(request.chain)
        if not matches or blocks == 0:
            return {r.replica_id: 0.0 for r in replicas}
        return {r.replica_id: min(1.0, matches.get(r.replica_id, 0) / blocks) for r in replicas}
