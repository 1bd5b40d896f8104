"""Candidate pruning: in a large fleet, score only the replicas that can win.

Scoring is Python per replica (a few µs each for ``fleet-cost``), so a decision over 1,000
replicas would spend milliseconds costing replicas that never had a chance: a request can only
be cheap on a replica that holds its prefix (no prefill to redo), holds its adapter (no cold
load) or is lightly loaded. Past ``above`` candidates, the engine keeps exactly those: every
replica the index matched, every replica with the request's adapter resident (GPU or host), and
the ``least_loaded`` others with the lowest load.

When it changes nothing: among replicas with no prefix and no adapter, the prompt costs the same
prefill everywhere, so the cheapest is the least busy one whenever the figures the scorer reads
(running, waiting, backlog, recent prefill, KV usage, staleness) rise together with ``load``;
then the pruned decision is the full one (``tests/unit/test_prune.py`` checks it on generated
fleets). When they do not (a replica with few requests but a stale reading, a slower engine), the
winner among the cache misses is the best of the ``least_loaded`` lightest instead of the best of
all: a cache miss either way, on a lightly loaded replica.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from routing.contracts import RoutingRequest
from routing.state import ReplicaState
from routing.types import ReplicaId

__all__ = ["PRUNED", "Pruning", "prune"]

#: ``ReplicaExplanation.filtered_out_by`` of a replica pruned before scoring.
PRUNED = "pruned"


@dataclass(frozen=True)
class Pruning:
    """When to prune, and how many cache-miss replicas to keep."""

    #: Prune only when more candidates than this survive the filters (small fleets: never).
    above: int = 64
    #: Replicas kept besides those holding the prefix or adapter: the least loaded ones.
    least_loaded: int = 16

    def __post_init__(self) -> None:
        for name in ("above", "least_loaded"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"pruning {name} must be a positive integer (got {value!r})")


def prune(
    request: RoutingRequest,
    candidates: Sequence[ReplicaState],
    loads: Mapping[ReplicaId, float],
    pruning: Pruning,
) -> Sequence[ReplicaState]:
    """The candidates worth scoring for ``request`` (``candidates`` itself when not pruning)."""
    if len(candidates) <= pruning.above:
        return candidates
    matches = request.prefix_matches or {}
    adapter = request.adapter
    keep: list[ReplicaState] = []
    rest: list[ReplicaState] = []
    for replica in candidates:
        if matches.get(replica.replica_id) or (
            adapter is not None
            and (adapter in replica.loaded_adapters or adapter in replica.cpu_cached_adapters)
        ):
            keep.append(replica)
        else:
            rest.append(replica)
    k = pruning.least_loaded
    if len(rest) > k:
        # Load, then the queue the engine reports, then KV usage: the busier of two equally
        # loaded replicas goes first. nsmallest is stable, so full ties keep the fleet's order.
        rest = heapq.nsmallest(
            k, rest, key=lambda r: (loads[r.replica_id], r.waiting, r.kv_usage)
        )
    return keep + rest
