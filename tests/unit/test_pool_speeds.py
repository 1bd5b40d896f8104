"""A pool's configured engine speeds reach every replica of it, static or registered by an agent."""

from __future__ import annotations

import pytest

from gateway.policy_view import PoolSpeeds, from_policy
from gateway.replicas import ReplicaRegistry
from routing.config import PolicyError, parse_policy
from routing.state import ReplicaState
from routing.types import ReplicaId

POLICY = """
version: 1
replica_pools:
  - name: h100
    replicas: ["http://10.0.0.1:8000"]
    prefill_tokens_per_s: 25000
    decode_step_ms: 8.5
    discovery: {redis_url: "redis://127.0.0.1:6379"}
  - name: plain
    replicas: ["http://10.0.0.2:8000"]
models:
  - {name: base-model, pools: [h100, plain]}
"""


def test_the_policy_gives_each_pool_its_speeds_and_defaults_where_it_is_silent() -> None:
    view = from_policy(parse_policy(POLICY))
    assert view.pool_speeds == {"h100": PoolSpeeds(25_000.0, 8.5), "plain": PoolSpeeds()}
    static = {spec.pool: spec for spec in view.replicas}
    h100, plain = static["h100"].speeds, static["plain"].speeds
    assert (h100.prefill_tokens_per_s, h100.decode_step_ms) == (25_000.0, 8.5)
    assert (plain.prefill_tokens_per_s, plain.decode_step_ms) == (10_000.0, 30.0)
    with pytest.raises(PolicyError, match="decode_step_ms"):
        parse_policy(POLICY.replace("decode_step_ms: 8.5", "decode_step_ms: 0"))


def test_static_and_registered_replicas_start_from_their_pools_speeds() -> None:
    view = from_policy(parse_policy(POLICY))
    registry = ReplicaRegistry(discovery_grace_s=0)
    registry.set_static(view.replicas)
    registry.set_pool_speeds(view.pool_speeds)
    static = registry.get(ReplicaId("h100/0"))
    assert static is not None and static.decode_step_ms == 8.5
    # An agent reports its engine's figures, not the speeds routing starts from: the pool's
    # apply at every sync; a pool the policy does not name keeps the defaults.
    registry.sync_discovered([
        ReplicaState(replica_id=ReplicaId("pod-a"), url="http://pod-a", pool="h100", running=3),
        ReplicaState(replica_id=ReplicaId("pod-b"), url="http://pod-b", pool="elsewhere"),
    ])
    a, b = registry.get(ReplicaId("pod-a")), registry.get(ReplicaId("pod-b"))
    assert a is not None and (a.prefill_tokens_per_s, a.decode_step_ms, a.running) == (
        25_000.0,
        8.5,
        3,
    )
    assert b is not None and (b.prefill_tokens_per_s, b.decode_step_ms) == (10_000.0, 30.0)
    # A reload that changes the pool's speeds applies them to the registered replicas at once.
    registry.set_pool_speeds({"h100": PoolSpeeds(20_000.0, 9.0)})
    a = registry.get(ReplicaId("pod-a"))
    assert a is not None and (a.prefill_tokens_per_s, a.decode_step_ms) == (20_000.0, 9.0)
