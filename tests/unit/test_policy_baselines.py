"""Baseline pickers: round-robin, random, least-loaded, power-of-two."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from routing.contracts import RoutingRequest
from routing.policies.least_loaded import LeastLoadedPicker
from routing.policies.power_of_two import PowerOfTwoPicker
from routing.policies.random_choice import RandomPicker
from routing.policies.round_robin import RoundRobinPicker
from routing.state import ReplicaState
from routing.types import ReplicaId


def rep(rid: str, load: int = 0) -> ReplicaState:
    return ReplicaState(
        replica_id=ReplicaId(rid), url=f"http://{rid}", models=frozenset({"m"}), running=load
    )


def req(seed: int | None = 1, **fields: Any) -> RoutingRequest:
    return RoutingRequest(
        request_id="r", model="m", adapter=None, tenant="t", route="d", prompt_tokens=10,
        seed=seed, **fields,
    )


def test_round_robin_rotates_over_sorted_ids_whatever_the_input_order() -> None:
    picker = RoundRobinPicker()
    replicas = [rep("c"), rep("a"), rep("b")]
    orders = [picker.pick(req(), replicas, {}) for _ in range(4)]
    assert orders == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_round_robin_ignores_load() -> None:
    picker = RoundRobinPicker()
    replicas = [rep("a", load=100), rep("b")]
    assert [picker.pick(req(), replicas, {})[0] for _ in range(2)] == ["a", "b"]


def test_random_is_a_permutation_fixed_by_the_seed_and_covers_every_replica() -> None:
    picker = RandomPicker()
    replicas = [rep(x) for x in "abcd"]
    first = picker.pick(req(seed=5), replicas, {})
    assert sorted(first) == ["a", "b", "c", "d"]
    assert picker.pick(req(seed=5), list(reversed(replicas)), {}) == first
    chosen = Counter(picker.pick(req(seed=s), replicas, {})[0] for s in range(400))
    assert set(chosen) == {"a", "b", "c", "d"}
    assert min(chosen.values()) > 50  # roughly uniform: 100 expected each


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ({"a": 3, "b": 1, "c": 2}, ["b", "c", "a"]),
        ({"a": 0, "b": 9}, ["a", "b"]),
    ],
)
def test_least_loaded_orders_by_load(loads: dict[str, int], expected: list[str]) -> None:
    replicas = [rep(rid, load) for rid, load in loads.items()]
    assert LeastLoadedPicker().pick(req(), replicas, {}) == expected


def test_least_loaded_breaks_ties_at_random() -> None:
    replicas = [rep("a", 1), rep("b", 1), rep("c", 5)]
    picker = LeastLoadedPicker()
    firsts = Counter(picker.pick(req(seed=s), replicas, {})[0] for s in range(100))
    assert set(firsts) == {"a", "b"}
    assert picker.pick(req(seed=3), replicas, {}) == picker.pick(req(seed=3), replicas, {})


def test_power_of_two_never_picks_the_strictly_most_loaded_and_returns_everyone() -> None:
    replicas = [rep("a", 0), rep("b", 4), rep("c", 6), rep("d", 9)]
    picker = PowerOfTwoPicker()
    firsts: Counter[str] = Counter()
    for seed in range(300):
        order = picker.pick(req(seed=seed), replicas, {})
        assert sorted(order) == ["a", "b", "c", "d"]
        loads = {r.replica_id: r.load for r in replicas}
        assert loads[order[0]] <= loads[order[1]]  # the pair, less loaded first
        assert loads[order[2]] <= loads[order[3]]  # the rest by load
        firsts[order[0]] += 1
    assert "d" not in firsts
    # "a" wins every pair it is drawn into (3 of 6 pairs); "c" only the pair (c, d).
    assert firsts["a"] > firsts["b"] > firsts["c"] > 0


def test_power_of_two_with_one_replica() -> None:
    assert PowerOfTwoPicker().pick(req(), [rep("a")], {}) == ["a"]
