"""``lora-affinity`` scorer: prefer replicas where the request's LoRA adapter is cheapest to use.

Adapter resident in a GPU slot > cached in host memory > a free GPU slot to load into > a slot
must be freed by evicting another adapter. Requests for a base model score 1 everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field, model_validator

from routing.contracts import RoutingRequest
from routing.policies.base import Plugin, PluginKind, PluginParams
from routing.state import ReplicaState
from routing.types import ReplicaId


class LoraAffinityScorer(Plugin):
    """Scores replicas by how ready they are to serve the request's adapter."""

    type_name: ClassVar[str] = "lora-affinity"
    kind: ClassVar[PluginKind] = "scorer"

    class Params(PluginParams):
        """Parameters of ``lora-affinity``: the score of each adapter situation."""

        resident: float = Field(default=1.0, ge=0.0, le=1.0)
        cpu_cached: float = Field(default=0.6, ge=0.0, le=1.0)
        #: A free GPU slot, or an unknown slot count (``max_loras`` not reported).
        free_slot: float = Field(default=0.3, ge=0.0, le=1.0)
        must_evict: float = Field(default=0.0, ge=0.0, le=1.0)

        @model_validator(mode="after")
        def _ordered(self) -> LoraAffinityScorer.Params:
            if not self.resident >= self.cpu_cached >= self.free_slot >= self.must_evict:
                raise ValueError(
                    "scores must not increase with the cost of loading: need resident "
                    f"({self.resident}) >= cpu_cached ({self.cpu_cached}) >= free_slot "
                    f"({self.free_slot}) >= must_evict ({self.must_evict})"
                )
            return self

    params: Params

    def score(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> dict[ReplicaId, float]:
        """Per replica, the score of the adapter's situation there."""
        adapter = request.adapter
        if not adapter:
            return {r.replica_id: 1.0 for r in replicas}
        return {r.replica_id: self._situation_score(adapter, r) for r in replicas}

    def _situation_score(self, adapter: str, replica: ReplicaState) -> float:
        if adapter in replica.loaded_adapters:
            return self.params.resident
        if adapter in replica.cpu_cached_adapters:
            return self.params.cpu_cached
        free = replica.free_adapter_slots
        if free is None or free > 0:
            return self.params.free_slot
        return self.params.must_evict
