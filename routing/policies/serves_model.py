"""``serves-model``: keep only healthy replicas that serve the request's base model.

The engine always runs this filter first, whatever the profile says: routing to an unhealthy
replica, or to one without the base model, can only fail. Adapter residency is not checked here
(any replica with the base model can load the adapter); scorers weigh adapter affinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.policies.base import Plugin, PluginKind
from routing.state import ReplicaState


class ServesModelFilter(Plugin):
    """Drops unhealthy replicas and replicas that do not serve ``request.model``."""

    type_name: ClassVar[str] = "serves-model"
    kind: ClassVar[PluginKind] = "filter"

    def filter(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> list[ReplicaState]:
        """The replicas that are healthy and serve the request's base model."""
        return [r for r in replicas if r.healthy and request.model in r.models]
