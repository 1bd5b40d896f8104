"""``least-loaded`` policy: the replica with the fewest requests queued or running.

Load is ``ReplicaState.load`` (the larger of the engine's running + waiting and the gateway's
in-flight count). Equal loads are broken at random so a burst does not pile onto one replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.engine import Profile
from routing.policies.base import Plugin, PluginKind, order_by_load
from routing.state import ReplicaState
from routing.types import ReplicaId


class LeastLoadedPicker(Plugin):
    """Orders candidates from least to most loaded."""

    type_name: ClassVar[str] = "least-loaded"
    kind: ClassVar[PluginKind] = "picker"

    def pick(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> list[ReplicaId]:
        """Candidates by ascending load, random among equals."""
        return order_by_load(replicas, self.rng(request))


def profile() -> Profile:
    """The built-in ``least-loaded`` profile."""
    return Profile(name="least-loaded", filters=(), scorers=(), picker=LeastLoadedPicker())
