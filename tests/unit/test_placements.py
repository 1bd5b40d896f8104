"""``Placements``: requests in flight by replica, moved by retries, bounded."""

from __future__ import annotations

from routing.policies.placements import Placements
from routing.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


def test_a_request_counts_where_it_runs_and_moves_with_a_retry() -> None:
    placed: Placements[int] = Placements(limit=10)
    placed.place("r1", A, 3)
    placed.place("r2", A, 7)
    assert (placed.count(A), sorted(placed.on(A))) == (2, [3, 7])
    placed.place("r1", B, 3)  # retried on b
    assert (placed.on(A), placed.on(B), len(placed)) == ([7], [3], 2)
    placed.forget("r2")
    placed.forget("never-placed")
    assert (placed.count(A), placed.count(B), placed.count(ReplicaId("c"))) == (0, 1, 0)


def test_past_the_limit_the_oldest_is_forgotten() -> None:
    placed: Placements[None] = Placements(limit=2)
    for rid in ("old", "mid", "new"):
        placed.place(rid, A, None)
    assert (len(placed), placed.count(A)) == (2, 2)
    placed.forget("old")  # already forgotten: the count stays right
    assert placed.count(A) == 2
    placed.place("mid", B, None)  # a retry refreshes it: "new" is now the oldest
    placed.place("newest", B, None)
    assert (placed.count(A), placed.count(B)) == (0, 2)
