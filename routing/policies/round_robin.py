"""``round-robin`` policy: each decision starts one replica further along, ignoring load and cache.

A baseline: it spreads requests evenly in count, but not in work, and never reuses a prefix on
purpose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.engine import Profile
from routing.policies.base import Plugin, PluginKind, PluginParams
from routing.state import ReplicaState
from routing.types import ReplicaId


class RoundRobinPicker(Plugin):
    """Rotates through the candidates, sorted by id so the rotation is stable across calls."""

    type_name: ClassVar[str] = "round-robin"
    kind: ClassVar[PluginKind] = "picker"

    def __init__(self, params: PluginParams | None = None, *, name: str | None = None) -> None:
        super().__init__(params, name=name)
        # Shared by every request through this instance: the rotation is the plugin's only state.
        self._next = 0

    def pick(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> list[ReplicaId]:
        """All candidates, starting with the next one in turn."""
        ids = sorted(r.replica_id for r in replicas)
        if not ids:
            return []
        start = self._next % len(ids)
        self._next += 1
        return ids[start:] + ids[:start]


def profile() -> Profile:
    """The built-in ``round-robin`` profile."""
    return Profile(name="round-robin", filters=(), scorers=(), picker=RoundRobinPicker())
