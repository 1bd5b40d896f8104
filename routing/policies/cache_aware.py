"""``cache-aware`` policy: SGLang's rule of thumb between cache reuse and load balance.

1. If the load is imbalanced — ``max - min > balance_abs_threshold`` *and*
   ``max > balance_rel_threshold * min`` — send to the least loaded replica.
2. Otherwise, if the best prefix match covers at least ``cache_threshold`` of the prompt, send to
   that replica (the least loaded among equal matches).
3. Otherwise send to the least loaded replica.

Match ratio is cached tokens / prompt tokens, from the block index. Without index data (degraded)
every ratio is 0 and the rule reduces to least-loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import Field

from routing.contracts import RoutingRequest
from routing.engine import PluginTerms, Profile
from routing.policies.base import (
    ExplainingPicker,
    PluginKind,
    PluginParams,
    match_ratio,
    order_by_load,
)
from routing.state import ReplicaState
from routing.types import ReplicaId


class CacheAwarePicker(ExplainingPicker):
    """Least loaded when imbalanced, else best prefix match above a threshold, else least loaded."""

    type_name: ClassVar[str] = "cache-aware"
    kind: ClassVar[PluginKind] = "picker"
    needs_prefix: ClassVar[bool] = True

    class Params(PluginParams):
        """Parameters of ``cache-aware``."""

        #: Imbalanced needs max - min load above this many requests ...
        balance_abs_threshold: int = Field(default=32, ge=0)
        #: ... and max load above this multiple of the min load.
        balance_rel_threshold: float = Field(default=1.5, ge=1.0)
        #: Minimum share of the prompt cached on a replica for the cache to win, in [0, 1].
        cache_threshold: float = Field(default=0.5, ge=0.0, le=1.0)

    params: Params

    def pick_with_terms(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> tuple[list[ReplicaId], PluginTerms]:
        """``pick`` plus each replica's match ratio and which branch of the rule applied."""
        if not replicas:
            return [], {}
        by_load = order_by_load(replicas, self.rng(request))
        loads = [r.load for r in replicas]
        low, high = min(loads), max(loads)
        imbalanced = (
            high - low > self.params.balance_abs_threshold
            and high > self.params.balance_rel_threshold * low
        )
        ratios = {r.replica_id: match_ratio(request, r.replica_id) for r in replicas}
        cache_wins = False
        order = by_load
        if not imbalanced:
            load_rank = {rid: rank for rank, rid in enumerate(by_load)}
            best = max(ratios.values())
            if best > 0 and best >= self.params.cache_threshold:
                cache_wins = True
                # Best match first; among equal matches the less loaded (by_load's order).
                order = sorted(by_load, key=lambda rid: (-ratios[rid], load_rank[rid]))
        terms: dict[ReplicaId, dict[str, float]] = {
            rid: {
                "match_ratio": ratio,
                "load_imbalanced": float(imbalanced),
                "cache_branch": float(cache_wins),
            }
            for rid, ratio in ratios.items()
        }
        return order, terms


def profile() -> Profile:
    """The built-in ``cache-aware`` profile."""
    return Profile(name="cache-aware", filters=(), scorers=(), picker=CacheAwarePicker())
