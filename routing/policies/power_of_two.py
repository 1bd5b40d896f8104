"""``power-of-two`` policy: sample two replicas at random, send to the less loaded one.

The classic "power of two choices": nearly as well balanced as least-loaded, but many gateways
acting on the same stale load figures do not all herd onto the one replica that looks emptiest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.engine import Profile
from routing.policies.base import Plugin, PluginKind, order_by_load
from routing.state import ReplicaState
from routing.types import ReplicaId


class PowerOfTwoPicker(Plugin):
    """The less loaded of two random candidates first, the other second, the rest by load."""

    type_name: ClassVar[str] = "power-of-two"
    kind: ClassVar[PluginKind] = "picker"

    def pick(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> list[ReplicaId]:
        """Two random choices, the less loaded first; remaining candidates follow by load."""
        rng = self.rng(request)
        ordered = sorted(replicas, key=lambda r: r.replica_id)  # a seed gives the same sample
        if len(ordered) < 2:
            return [r.replica_id for r in ordered]
        first, second = rng.sample(ordered, 2)
        # On equal load keep the first draw: it is already random.
        if second.load < first.load:
            first, second = second, first
        chosen = {first.replica_id, second.replica_id}
        rest = order_by_load((r for r in ordered if r.replica_id not in chosen), rng)
        return [first.replica_id, second.replica_id, *rest]


def profile() -> Profile:
    """The built-in ``power-of-two`` profile."""
    return Profile(name="power-of-two", filters=(), scorers=(), picker=PowerOfTwoPicker())
