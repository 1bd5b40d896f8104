"""Candidate pruning: in a large fleet, score only the replicas that can win.

Scoring is Python per replica (a few µs each for ``fleet-cost``), so a decision over 1,000
replicas would spend milliseconds costing replicas that never had a chance. What a request costs
on a replica, apart from how busy it is, depends on the depth of the prefix it holds (0: a miss)
and, for an adapter request, on whether the adapter is on its GPU, in host memory or absent.
Past ``above`` candidates, the engine groups them by those and scores only the ``least_loaded``
lightest of each group (equal loads drawn at random): a hot prefix held by ninety replicas is
costed on sixteen of them, and so are the misses.

When it changes nothing: within a group the prompt costs the same prefill everywhere, so the
cheapest member is the least busy one whenever the figures the scorer reads (running, waiting,
backlog, recent prefill, KV usage, staleness) rise together with ``load``; then the pruned
decision is the full one (``tests/unit/test_prune.py`` checks it on generated fleets). When they
do not (a replica with few requests but a stale reading, a slower engine), a group's winner is
the best of its ``least_loaded`` lightest members instead of the best of all of them.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from routing.contracts import CandidatesSummary, RoutingRequest
from routing.state import ReplicaState
from routing.types import ReplicaId

__all__ = ["PRUNED", "Pruned", "Pruning", "prune"]

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


@dataclass(frozen=True)
class Pruned:
    """What ``prune`` hands back to the engine."""

    #: The replicas to score: ``candidates`` itself when there were too few to prune.
    scored: list[ReplicaState]
    #: Every candidate's fleet-wide figures; ``None`` when nothing was pruned.
    summary: CandidatesSummary | None
    #: The load of every replica the pass saw (candidates, and those ``serves`` removed).
    loads: Mapping[ReplicaId, float]
    #: The candidates: what survived ``serves`` (or what the caller passed).
    candidates: Sequence[ReplicaState]
    #: Replicas the ``serves`` check removed (unhealthy, or without the model).
    removed: list[ReplicaId]


def prune(
    request: RoutingRequest,
    candidates: Sequence[ReplicaState],
    pruning: Pruning,
    draw: Callable[[], float] = random.random,
    loads: Mapping[ReplicaId, float] | None = None,
    serves: str | None = None,
) -> Pruned:
    """The candidates worth scoring for ``request``, in one pass over the fleet.

    Each group keeps its ``least_loaded`` lightest members in a bounded heap, and the pass sums
    every candidate's load and queue. Loads are whole requests, read here (``ReplicaState.load``)
    unless ``loads`` gives them; ``draw()`` in [0, 1) breaks ties between equal loads at random,
    so an idle fleet's new prefixes spread over all of it, not over the first few replicas in
    the registry's order. With ``serves`` (a model name) the pass is also the engine's built-in
    ``serves-model`` filter: unhealthy replicas and those without the model are removed first,
    and nothing is pruned if no more than ``pruning.above`` remain.
    """
    read: dict[ReplicaId, float] | None = {} if loads is None else None
    matches = request.prefix_matches or {}
    adapter = request.adapter
    k = pruning.least_loaded
    #: Group -> max-heap of its k lightest members so far: (-key, position, replica).
    groups: dict[object, list[tuple[float, int, ReplicaState]]] = {}
    kept: list[ReplicaState] | Sequence[ReplicaState] = [] if serves is not None else candidates
    removed: list[ReplicaId] = []
    total_load = 0.0
    total_queued = 0
    push, replace_top = heapq.heappush, heapq.heapreplace
    for position, replica in enumerate(candidates):
        rid = replica.replica_id
        # ReplicaState.load and .queued, inline: this loop is the hot path of a large fleet's
        # decision, and a property call per replica is a third of its time.
        running, waiting, inflight = replica.running, replica.waiting, replica.inflight_requests
        if read is not None:
            load = float(running + waiting if running + waiting > inflight else inflight)
            read[rid] = load
        else:
            load = loads[rid]  # type: ignore[index]
        if serves is not None:
            if not replica.healthy or serves not in replica.models:
                removed.append(rid)
                continue
            kept.append(replica)  # type: ignore[union-attr]
        total_load += load
        queued = inflight - running
        if waiting > queued:
            queued = waiting
        if queued > 0:
            total_queued += queued
        group: object = matches.get(rid, 0) if matches else 0
        if adapter is not None:
            where = (
                2
                if adapter in replica.loaded_adapters
                else 1
                if adapter in replica.cpu_cached_adapters
                else 0
            )
            group = (group, where)
        heap = groups.get(group)
        if heap is None:
            heap = groups[group] = []
        key = load + draw()
        if len(heap) < k:
            push(heap, (-key, position, replica))
        elif key < -heap[0][0]:
            replace_top(heap, (-key, position, replica))
    used = read if read is not None else loads
    assert used is not None
    count = len(kept)
    if count <= pruning.above:
        return Pruned(list(kept), None, used, kept, removed)
    summary = CandidatesSummary(count, total_load / count, total_queued / count)
    scored = [replica for heap in groups.values() for _, _, replica in heap]
    return Pruned(scored, summary, used, kept, removed)
