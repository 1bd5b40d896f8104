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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np

from routing.contracts import CandidatesSummary, RoutingRequest
from routing.fleet import Fleet, adapter_residence
from routing.state import ReplicaState
from routing.types import ReplicaId

__all__ = ["PRUNED", "Pruned", "Pruning", "prune"]

#: ``ReplicaExplanation.filtered_out_by`` of a replica pruned before scoring.
PRUNED = "pruned"

_ID = attrgetter("replica_id")
_RUNNING = attrgetter("running")
_WAITING = attrgetter("waiting")
_INFLIGHT = attrgetter("inflight_requests")
_QUEUED = attrgetter("queued")
#: Tie draws for callers that bring no generator of their own.
_RNG = np.random.default_rng()


@dataclass(frozen=True)
class Pruning:
    """When to prune, and how many replicas of each group to keep."""

    #: Prune only when more candidates than this survive the filters (small fleets: never).
    above: int = 64
    #: Replicas kept of each prefix-depth / adapter group: its least loaded ones (holders too,
    #: so a prefix held by ninety replicas is costed on this many).
    least_loaded: int = 16

    def __post_init__(self) -> None:
        for name in ("above", "least_loaded"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"pruning {name} must be a positive integer (got {value!r})")


@dataclass(frozen=True)
class Pruned:
    """What ``prune`` hands back to the engine."""

    #: The replicas to score: every candidate when there were too few to prune.
    scored: list[ReplicaState]
    #: Every candidate's fleet-wide figures; ``None`` when nothing was pruned.
    summary: CandidatesSummary | None
    #: The load of every replica the pass saw (candidates, and those ``serves`` removed).
    loads: Mapping[ReplicaId, float]
    #: How many candidates there were: those that survived ``serves`` (or all that were passed).
    count: int
    #: Replicas the ``serves`` check removed (unhealthy, or without the model).
    removed: list[ReplicaId]


def prune(
    request: RoutingRequest,
    candidates: Sequence[ReplicaState],
    pruning: Pruning,
    rng: np.random.Generator | None = None,
    loads: Mapping[ReplicaId, float] | None = None,
    serves: str | None = None,
) -> Pruned:
    """The candidates worth scoring for ``request``, in one pass over the fleet.

    The pass takes every candidate's load and queue as arrays (loads are whole requests, as
    ``ReplicaState.load`` gives them, unless ``loads`` gives them), groups candidates by prefix
    depth and adapter residence, and keeps each group's ``least_loaded`` lightest members. Equal
    loads are ordered by a uniform draw from ``rng`` in [0, 1), so an idle fleet's new prefixes
    spread over all of it, not over the first few replicas in the registry's order. With
    ``serves`` (a model name) the pass is also the engine's built-in ``serves-model`` filter:
    unhealthy replicas and those without the model are removed first, and nothing is pruned if
    no more than ``pruning.above`` remain. The kept replicas come back in the fleet's order.

    A ``Fleet`` (routing/fleet.py) hands its arrays over as they are; any other sequence is
    read replica by replica.
    """
    figures = _Figures.of(candidates, request, serves)
    n = len(figures.states)
    if loads is None:
        load = np.maximum(figures.running + figures.waiting, figures.inflight).astype(np.float64)
    else:
        load = np.fromiter(map(loads.__getitem__, map(_ID, figures.states)), np.float64, n)
    seen = _Loads(figures.states, load)
    mask = figures.serving
    removed: list[ReplicaId] = []
    kept_at: np.ndarray | None = None  # positions of the candidates, when some were removed
    if mask is not None and not mask.all():
        kept_at = np.flatnonzero(mask)
        removed = [figures.states[i].replica_id for i in np.flatnonzero(~mask).tolist()]
    count = n if kept_at is None else len(kept_at)
    if count <= pruning.above:
        kept = list(figures.states) if kept_at is None else _at(figures.states, kept_at.tolist())
        return Pruned(kept, None, seen, count, removed)
    queued, group = figures.queued, figures.group
    if kept_at is not None:
        queued = queued[kept_at]
        load = load[kept_at]
        group = group[kept_at] if group is not None else None
    summary = CandidatesSummary(count, float(load.sum()) / count, float(queued.sum()) / count)
    keys = load + (rng if rng is not None else _RNG).random(count)
    k = pruning.least_loaded
    if group is None:  # one group (no prefix held, no adapter asked): the k lightest
        chosen = np.argpartition(keys, k)[:k] if count > k else np.arange(count)
    else:
        # Sort by (group, key); keep the first k of each group's run.
        order = np.lexsort((keys, group))
        in_order = group[order]
        starts = np.empty(count, np.bool_)
        starts[0] = True
        np.not_equal(in_order[1:], in_order[:-1], out=starts[1:])
        positions = np.arange(count)
        run_start = np.maximum.accumulate(np.where(starts, positions, 0))
        chosen = order[positions - run_start < k]
    chosen.sort()
    if kept_at is not None:
        chosen = kept_at[chosen]
    return Pruned(_at(figures.states, chosen.tolist()), summary, seen, count, removed)


def _at(states: Sequence[ReplicaState], positions: list[int]) -> list[ReplicaState]:
    """``states`` at ``positions`` (a Fleet hands them over without a method call each)."""
    if isinstance(states, Fleet):
        return states.states(positions)
    return [states[i] for i in positions]


@dataclass
class _Figures:
    """What the pass reads of the candidates, as arrays over ``states`` (in their order)."""

    states: Sequence[ReplicaState]
    running: np.ndarray
    waiting: np.ndarray
    inflight: np.ndarray
    #: ``ReplicaState.queued`` per replica.
    queued: np.ndarray
    #: Healthy and serving the model, when the pass filters; None otherwise.
    serving: np.ndarray | None
    #: Group code (prefix depth, then adapter residence); None when all are in one group.
    group: np.ndarray | None

    @classmethod
    def of(
        cls, candidates: Sequence[ReplicaState], request: RoutingRequest, serves: str | None
    ) -> _Figures:
        matches = request.prefix_matches
        adapter = request.adapter
        if isinstance(candidates, Fleet):
            fleet = candidates
            group = fleet.depths(matches) * 3 if matches else None
            if adapter is not None:
                residence = fleet.adapter_residence(adapter)
                group = residence.copy() if group is None else group + residence
            return cls(
                fleet,
                fleet.running,
                fleet.waiting,
                fleet.inflight,
                fleet.queued,
                fleet.serving(serves) if serves is not None else None,
                group,
            )
        states = list(candidates)
        n = len(states)
        # Attribute reads through C-level iterators into arrays: a Python loop doing the same
        # per replica costs twice as much.
        serving = None
        if serves is not None:
            serving = np.fromiter((r.healthy and serves in r.models for r in states), np.bool_, n)
        group = None
        if matches:
            group = np.fromiter(map(matches.get, map(_ID, states), repeat(0)), np.int64, n) * 3
        if adapter is not None:
            residence = adapter_residence(states, adapter)
            group = residence if group is None else group + residence
        return cls(
            states,
            np.fromiter(map(_RUNNING, states), np.int64, n),
            np.fromiter(map(_WAITING, states), np.int64, n),
            np.fromiter(map(_INFLIGHT, states), np.int64, n),
            np.fromiter(map(_QUEUED, states), np.int64, n),
            serving,
            group,
        )


class _Loads(Mapping[ReplicaId, float]):
    """Each replica's load at decision time, keyed by replica; the dict is built on first read
    (most decisions never read it)."""

    __slots__ = ("_by_id", "_states", "_values")

    def __init__(self, states: Sequence[ReplicaState], values: np.ndarray) -> None:
        self._states = list(states)  # a Fleet changes after the decision: keep who was there
        self._values = values
        self._by_id: dict[ReplicaId, float] | None = None

    def _map(self) -> dict[ReplicaId, float]:
        if self._by_id is None:
            self._by_id = dict(zip(map(_ID, self._states), self._values.tolist(), strict=True))
        return self._by_id

    def __getitem__(self, key: ReplicaId) -> float:
        return self._map()[key]

    def get(self, key: ReplicaId, default: Any = None) -> Any:  # type: ignore[override]
        return self._map().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._map()

    def __iter__(self) -> Iterator[ReplicaId]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._states)
