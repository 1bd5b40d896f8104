"""``kv-pressure`` scorer: steer away from replicas whose KV cache is nearly full.

Above ``threshold`` a new request is likely to force preemptions (vLLM evicts running requests
and recomputes them later), so the score falls gently up to the threshold and steeply after:
1.0 at empty, 0.5 at the threshold, 0.0 when full.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from routing.contracts import RoutingRequest
from routing.policies.base import Plugin, PluginKind, PluginParams
from routing.state import ReplicaState
from routing.types import ReplicaId


class KvPressureScorer(Plugin):
    """Scores replicas by free KV cache, with a knee at ``threshold``."""

    type_name: ClassVar[str] = "kv-pressure"
    kind: ClassVar[PluginKind] = "scorer"

    class Params(PluginParams):
        """Parameters of ``kv-pressure``."""

        #: KV usage (0..1) where the score's slope turns steep; preemption risk starts here.
        threshold: float = Field(default=0.9, gt=0.0, lt=1.0)

    params: Params

    def score(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> dict[ReplicaId, float]:
        """Piecewise-linear in ``kv_usage_now`` (the gauge less the requests ended since it was
        read): 1 → 0.5 up to the threshold, 0.5 → 0 above it."""
        threshold = self.params.threshold
        scores: dict[ReplicaId, float] = {}
        for replica in replicas:
            usage = min(1.0, max(0.0, replica.kv_usage_now))
            if usage <= threshold:
                scores[replica.replica_id] = 1.0 - 0.5 * usage / threshold
            else:
                scores[replica.replica_id] = 0.5 * (1.0 - usage) / (1.0 - threshold)
        return scores
