"""``cache-aware``: SGLang's imbalance / match-threshold rule."""

from __future__ import annotations

import pytest

from routing.contracts import RoutingRequest
from routing.policies.cache_aware import CacheAwarePicker
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId

# 10 blocks of 16 tokens = the whole 160-token prompt.
PROMPT_TOKENS = 160


def rep(rid: str, load: int) -> ReplicaState:
    return ReplicaState(
        replica_id=ReplicaId(rid), url=f"http://{rid}", models=frozenset({"m"}), running=load
    )


def req(matches: dict[str, int] | None) -> RoutingRequest:
    return RoutingRequest(
        request_id="r", model="m", adapter=None, tenant="t", route="d",
        prompt_tokens=PROMPT_TOKENS, chain=[BlockHash(i) for i in range(10)], seed=1,
        prefix_matches=None if matches is None else {ReplicaId(k): v for k, v in matches.items()},
    )


PICKER = CacheAwarePicker(CacheAwarePicker.Params(
    balance_abs_threshold=10, balance_rel_threshold=2.0, cache_threshold=0.5
))


@pytest.mark.parametrize(
    ("loads", "matches", "expected_first", "cache_branch"),
    [
        # balanced, best match 8/10 >= 0.5: the cache wins even though "a" is busier
        ({"a": 5, "b": 0}, {"a": 8}, "a", 1.0),
        # balanced, best match 4/10 < 0.5: least loaded
        ({"a": 5, "b": 0}, {"a": 4}, "b", 0.0),
        # imbalanced: 30 - 1 > 10 and 30 > 2 x 1: least loaded despite a full match
        ({"a": 30, "b": 1}, {"a": 10}, "b", 0.0),
        # abs gap 25 > 10 but 40 < 2 x 25, so not imbalanced: the cache wins
        ({"a": 40, "b": 25}, {"a": 10}, "a", 1.0),
        # rel gap 12 > 2 x 5 but abs 7 <= 10: not imbalanced
        ({"a": 12, "b": 5}, {"a": 10}, "a", 1.0),
        # equal best matches: the less loaded of them
        ({"a": 3, "b": 2, "c": 0}, {"a": 9, "b": 9}, "b", 1.0),
        # no index data (degraded): least loaded
        ({"a": 5, "b": 0}, None, "b", 0.0),
    ],
)
def test_cache_aware_rule(
    loads: dict[str, int],
    matches: dict[str, int] | None,
    expected_first: str,
    cache_branch: float,
) -> None:
    replicas = [rep(rid, load) for rid, load in loads.items()]
    order, terms = PICKER.pick_with_terms(req(matches), replicas, {})
    assert order[0] == expected_first
    assert sorted(order) == sorted(loads)
    assert all(t["cache_branch"] == cache_branch for t in terms.values())


def test_match_ratio_is_reported_per_replica() -> None:
    _, terms = PICKER.pick_with_terms(req({"a": 5}), [rep("a", 0), rep("b", 0)], {})
    assert terms[ReplicaId("a")]["match_ratio"] == 0.5
    assert terms[ReplicaId("b")]["match_ratio"] == 0.0


def test_cache_aware_needs_prefix_data() -> None:
    assert CacheAwarePicker.needs_prefix
