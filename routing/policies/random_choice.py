"""``random`` policy: a uniformly random order of the candidates.

A baseline with no state and no inputs beyond the candidate list; ``request.seed`` makes it
deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.engine import Profile
from routing.policies.base import Plugin, PluginKind
from routing.state import ReplicaState
from routing.types import ReplicaId


class RandomPicker(Plugin):
    """Shuffles the candidates; the first is the choice, the rest are fallbacks."""

    type_name: ClassVar[str] = "random"
    kind: ClassVar[PluginKind] = "picker"

    def pick(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> list[ReplicaId]:
        """The candidates in random order."""
        ids = sorted(r.replica_id for r in replicas)  # sorted: a seed gives the same order always
        self.rng(request).shuffle(ids)
        return ids


def profile() -> Profile:
    """The built-in ``random`` profile."""
    return Profile(name="random", filters=(), scorers=(), picker=RandomPicker())
