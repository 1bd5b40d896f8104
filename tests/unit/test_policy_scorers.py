"""Composable scorers: prefix-affinity, lora-affinity, load, kv-pressure."""

from __future__ import annotations

from typing import Any

import pytest

from routing.contracts import RoutingRequest
from routing.policies.kv_pressure import KvPressureScorer
from routing.policies.load import LoadScorer
from routing.policies.lora_affinity import LoraAffinityScorer
from routing.policies.prefix_affinity import PrefixAffinityScorer
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId


def rep(rid: str, **fields: Any) -> ReplicaState:
    return ReplicaState(
        replica_id=ReplicaId(rid), url=f"http://{rid}", models=frozenset({"m"}), **fields
    )


def req(**fields: Any) -> RoutingRequest:
    values: dict[str, Any] = {
        "request_id": "r", "model": "m", "adapter": None, "tenant": "t", "route": "d",
        "prompt_tokens": 160, "chain": [BlockHash(i) for i in range(10)],
    }
    values.update(fields)
    return RoutingRequest(**values)


@pytest.mark.parametrize(
    ("matches", "expected"),
    [
        ({"a": 10, "b": 5}, {"a": 1.0, "b": 0.5, "c": 0.0}),
        ({}, {"a": 0.0, "b": 0.0, "c": 0.0}),
        (None, {"a": 0.0, "b": 0.0, "c": 0.0}),  # degraded: no opinion
    ],
)
def test_prefix_affinity(matches: dict[str, int] | None, expected: dict[str, float]) -> None:
    prefix = None if matches is None else {ReplicaId(k): v for k, v in matches.items()}
    replicas = [rep(x) for x in "abc"]
    assert PrefixAffinityScorer().score(req(prefix_matches=prefix), replicas) == expected


def test_lora_affinity_orders_adapter_situations() -> None:
    replicas = [
        rep("resident", loaded_adapters=frozenset({"ad"}), max_loras=1),
        rep("cached", cpu_cached_adapters=frozenset({"ad"}), max_loras=2,
            loaded_adapters=frozenset({"x", "y"})),
        rep("free", max_loras=2, loaded_adapters=frozenset({"x"})),
        rep("unknown"),
        rep("full", max_loras=1, loaded_adapters=frozenset({"x"})),
    ]
    scores = LoraAffinityScorer().score(req(adapter="ad"), replicas)
    assert scores == {"resident": 1.0, "cached": 0.6, "free": 0.3, "unknown": 0.3, "full": 0.0}
    base = LoraAffinityScorer().score(req(adapter=None), replicas)
    assert set(base.values()) == {1.0}


def test_lora_affinity_params_must_keep_the_order() -> None:
    with pytest.raises(ValueError, match=r"resident \(0.1\) >= cpu_cached \(0.6\)"):
        LoraAffinityScorer.Params(resident=0.1)


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ({"a": 0, "b": 5, "c": 10}, {"a": 1.0, "b": 0.5, "c": 0.0}),
        ({"a": 3, "b": 3}, {"a": 1.0, "b": 1.0}),
    ],
)
def test_load_scorer_is_min_max_scaled(loads: dict[str, int], expected: dict[str, float]) -> None:
    replicas = [rep(rid, running=load) for rid, load in loads.items()]
    assert LoadScorer().score(req(), replicas) == expected


@pytest.mark.parametrize(
    ("usage", "expected"),
    [(0.0, 1.0), (0.45, 0.75), (0.9, 0.5), (0.95, 0.25), (1.0, 0.0), (1.3, 0.0)],
)
def test_kv_pressure_knee_at_threshold(usage: float, expected: float) -> None:
    scores = KvPressureScorer().score(req(), [rep("a", kv_usage=usage)])
    assert scores[ReplicaId("a")] == pytest.approx(expected)
