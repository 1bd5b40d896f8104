"""``DecisionRecord``: one finished request as ``/admin/decisions`` shows it, written once.

The account phase builds it from the route phase's ``RouteDecision`` and the forward phase's
``UpstreamOutcome`` and appends it to the decision log; nothing changes it afterwards. Its JSON
(``as_json``) keeps the keys, their order and their optional ones exactly as the log has always
shown them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from routing.contracts import ReplicaExplanation
from routing.types import ReplicaId


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    """The request's LoRA adapter, held on the replica that got it: loaded then, or already."""

    replica: ReplicaId
    cold_ms: float
    loaded_now: bool


@dataclass(frozen=True, slots=True)
class CachePrediction:
    """The index's predicted cached tokens against the engine's count (``exact``/over/under)."""

    predicted_cached_tokens: int
    outcome: str


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One routed request, its routing and its outcome (see the module doc)."""

    #: Wall-clock time of the routing decision (``time.time()``).
    at: float
    request_id: str
    route: str
    tenant: str
    model: str
    adapter: str | None
    prompt_tokens: int
    blocks: int
    replica: ReplicaId
    fallbacks: tuple[ReplicaId, ...]
    profile: str
    degraded: bool
    last_resort: bool
    timings_ms: Mapping[str, float]
    #: The engine's lazy explanation map, rendered only when /admin/decisions is read: copying
    #: every replica's terms on every request cost more than the routing decision itself.
    explanations: Mapping[ReplicaId, ReplicaExplanation]
    adapter_load: AdapterLoad | None
    prediction: CachePrediction | None
    #: The client's status (499: it left before the answer was complete).
    status: int
    served_by: ReplicaId | None
    cached_tokens: int | None
    ttft_ms: float | None
    #: The gateway's error ``code`` for a request it answered itself after routing it (flow
    #: control shed it, a token budget refused it, ...): never sent, so ``served_by`` is None.
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The log entry's JSON object (explanations rendered too)."""
        out: dict[str, Any] = {
            "at": self.at,
            "request_id": self.request_id,
            "route": self.route,
            "tenant": self.tenant,
            "model": self.model,
            "adapter": self.adapter,
            "prompt_tokens": self.prompt_tokens,
            "blocks": self.blocks,
            "replica": self.replica,
            "fallbacks": list(self.fallbacks),
            "profile": self.profile,
            "degraded": self.degraded,
            "last_resort": self.last_resort,
            "timings_ms": dict(self.timings_ms),
            "explanations": {
                rid: {
                    "matched_blocks": e.matched_blocks,
                    "scores": dict(e.scores),
                    "terms": dict(e.terms),
                    "filtered_out_by": e.filtered_out_by,
                }
                for rid, e in self.explanations.items()
            },
        }
        if self.adapter_load is not None:
            out["adapter_load"] = {
                "replica": self.adapter_load.replica,
                "cold_ms": round(self.adapter_load.cold_ms, 3),
                "loaded_now": self.adapter_load.loaded_now,
            }
        if self.prediction is not None:
            out["predicted_cached_tokens"] = self.prediction.predicted_cached_tokens
            out["prediction"] = self.prediction.outcome
        out["status"] = self.status
        out["served_by"] = self.served_by
        out["cached_tokens"] = self.cached_tokens
        out["ttft_ms"] = self.ttft_ms
        if self.error is not None:
            out["error"] = self.error
        return out
