"""Candidate pruning (routing/prune.py): past ``above`` candidates the engine scores only the
``least_loaded`` lightest replicas of each prefix-depth / adapter group, and where a group's
figures rise with its members' load, it decides what scoring everyone decides."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routing.contracts import RoutingRequest
from routing.engine import RoutingEngine
from routing.policies.registry import DEFAULT_PROFILE, builtin_profile
from routing.prune import PRUNED, Pruning
from routing.state import ReplicaState
from routing.types import ReplicaId

MODEL = "m"
BLOCK = 16


def replica(i: int, busy: int, *, adapters: frozenset[str] = frozenset()) -> ReplicaState:
    """A replica whose every load figure rises with ``busy``."""
    return ReplicaState(
        replica_id=ReplicaId(f"r{i:04d}"),
        url=f"http://r{i}",
        models=frozenset({MODEL}),
        running=busy,
        waiting=busy // 4,
        inflight_requests=busy,
        inflight_prefill_tokens=busy * 150,
        kv_usage=min(0.99, busy / 64),
        loaded_adapters=adapters,
        metrics_read_at=time.time(),
    )


def request(matches: dict[ReplicaId, int], prompt_blocks: int, seed: int) -> RoutingRequest:
    return RoutingRequest(
        request_id=f"q{seed}",
        model=MODEL,
        adapter=None,
        tenant="t",
        route="d",
        prompt_tokens=prompt_blocks * BLOCK,
        block_size=BLOCK,
        prefix_matches=matches,
        seed=seed,
    )


async def decide(replicas: list[ReplicaState], req: RoutingRequest, pruning: Pruning | None):
    profile = builtin_profile(DEFAULT_PROFILE)  # fresh: no state carried between the two runs
    engine = RoutingEngine(None, {profile.name: profile}, pruning=pruning)
    return await engine.route(req, replicas, profile.name)


fleets = st.integers(min_value=65, max_value=160).flatmap(
    lambda n: st.tuples(
        st.just(n),
        # a distinct busy level per replica: no two cache misses tie on load
        st.permutations(range(n)),
        st.dictionaries(st.integers(0, n - 1), st.integers(1, 120), max_size=12),
        st.integers(8, 400),
        st.integers(0, 2**16),
    )
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets)
async def test_pruned_decision_costs_what_the_full_one_costs(case) -> None:  # type: ignore[no-untyped-def]
    n, busy, matched, prompt_blocks, seed = case
    replicas = [replica(i, busy[i]) for i in range(n)]
    matches = {replicas[i].replica_id: min(blocks, prompt_blocks) for i, blocks in matched.items()}
    full = await decide(replicas, request(dict(matches), prompt_blocks, seed), None)
    pruned = await decide(replicas, request(dict(matches), prompt_blocks, seed), Pruning(64, 8))
    assert "prune" in pruned.timings_ms and "prune" not in full.timings_ms
    cost = {rid: e.terms["fleet_cost_ms"] for rid, e in full.explanations.items()}
    # The same replica, or one the full decision counts as a tie (1% with the 10 ms floor).
    assert cost[pruned.replica] + 10 <= (cost[full.replica] + 10) * 1.0101


async def test_small_fleets_are_never_pruned() -> None:
    replicas = [replica(i, i % 7) for i in range(64)]
    decision = await decide(replicas, request({}, 40, 1), Pruning(64, 4))
    assert "prune" not in decision.timings_ms
    assert all(e.filtered_out_by is None for e in decision.explanations.values())


async def test_holders_of_the_prefix_or_adapter_are_kept_and_the_rest_says_pruned() -> None:
    replicas = [replica(i, 30 + i % 5) for i in range(100)]
    replicas[7] = replica(7, 40, adapters=frozenset({"lora-x"}))
    replicas[90] = replica(90, 0)  # the lightest
    req = request({replicas[3].replica_id: 10}, 40, 2)
    req.adapter = "lora-x"
    decision = await decide(replicas, req, Pruning(64, 2))
    explained = decision.explanations
    scored = {rid for rid, e in explained.items() if e.filtered_out_by is None}
    assert {"r0003", "r0007", "r0090"} <= scored
    assert len(scored) == 4  # prefix holder, adapter holder, the two least loaded
    assert len(explained) == 100  # every replica is still explained
    assert explained[ReplicaId("r0050")].filtered_out_by == PRUNED
    assert decision.replica in scored and set(decision.fallbacks) == scored - {decision.replica}


async def test_the_load_guard_compares_with_the_whole_fleet() -> None:
    """A prefix holder twice as loaded as the lightest replicas but below the fleet's mean is
    eligible: pruned down to the lightest few, the guard would otherwise pass it over."""
    replicas = [replica(i, 20) for i in range(100)]
    for i in range(8):
        replicas[i] = replica(i, 1)
    replicas[50] = replica(50, 9)
    decision = await decide(replicas, request({replicas[50].replica_id: 60}, 64, 3), Pruning())
    assert decision.replica == "r0050"


def test_pruning_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="least_loaded"):
        Pruning(64, 0)


async def test_a_hot_prefix_is_costed_on_its_least_loaded_holders_only() -> None:
    replicas = [replica(i, 40 - i % 40) for i in range(200)]
    holders = {r.replica_id: 30 for r in replicas[:90]}  # ninety replicas hold the same prefix
    decision = await decide(replicas, request(holders, 40, 4), Pruning(64, 16))
    scored = [rid for rid, e in decision.explanations.items() if e.filtered_out_by is None]
    assert len(scored) == 32  # 16 holders + 16 misses
    holder_loads = sorted(r.load for r in replicas[:90])
    assert sorted(r.load for r in replicas if r.replica_id in scored and r.replica_id in holders) \
        == holder_loads[:16]
    full = await decide(replicas, request(holders, 40, 4), None)
    assert decision.replica == full.replica or (
        full.explanations[decision.replica].terms["fleet_cost_ms"]
        <= full.explanations[full.replica].terms["fleet_cost_ms"] * 1.0101 + 0.11
    )


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 50),
            st.integers(0, 50),
            st.integers(0, 50),
            st.none() | st.integers(0, 50),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_the_loads_read_in_the_pass_are_replica_state_load(figures) -> None:  # type: ignore[no-untyped-def]
    """The pass reads load and queue as arrays (no property call per replica in a Fleet): the
    same figures as ``ReplicaState``'s, whether or not the requests awaiting their first token
    are counted."""
    from routing.prune import prune

    replicas = [
        ReplicaState(
            ReplicaId(f"r{i}"),
            "u",
            running=r,
            waiting=w,
            inflight_requests=f,
            inflight_unprefilled=None if u is None else min(u, f),
        )
        for i, (r, w, f, u) in enumerate(figures)
    ]
    pruned = prune(request({}, 4, 0), replicas, Pruning(1, 1))
    summary, loads = pruned.summary, pruned.loads
    assert loads == {r.replica_id: float(r.load) for r in replicas}
    if len(replicas) == 1:
        assert summary is None  # one replica is not more than ``above``: nothing pruned
        return
    assert summary is not None
    assert summary.mean_queued == sum(r.queued for r in replicas) / len(replicas)
    assert summary.mean_load == sum(r.load for r in replicas) / len(replicas)


async def test_the_built_in_filter_runs_in_the_same_pass() -> None:
    """Unhealthy replicas and replicas without the model are removed and explained as the
    built-in filter's, with their loads; if too few remain, nothing is pruned; if none, 503."""
    from dataclasses import replace as copy_with

    from routing.contracts import NoReplicaAvailable

    replicas = [replica(i, i % 9) for i in range(120)]
    for i in range(0, 120, 3):
        replicas[i] = copy_with(replicas[i], healthy=False)
    for i in range(1, 120, 3):
        replicas[i] = copy_with(replicas[i], models=frozenset({"other"}))
    decision = await decide(replicas, request({}, 40, 5), Pruning(64, 8))
    explained = decision.explanations
    assert len(explained) == 120
    assert explained[ReplicaId("r0000")].filtered_out_by == "serves-model"
    assert explained[ReplicaId("r0001")].filtered_out_by == "serves-model"
    assert explained[ReplicaId("r0001")].terms["load"] == float(replicas[1].load)
    scored = {rid for rid, e in explained.items() if e.filtered_out_by is None}
    assert len(scored) == 40  # 40 survivors, not more than 64: none pruned
    assert "prune" in decision.timings_ms
    many = [replica(i, i % 9) for i in range(200)]
    for i in range(0, 200, 3):
        many[i] = copy_with(many[i], healthy=False)
    pruned = await decide(many, request({}, 40, 6), Pruning(64, 8))
    kept = {rid for rid, e in pruned.explanations.items() if e.filtered_out_by is None}
    assert len(kept) == 8 and all(int(rid[1:]) % 3 for rid in kept)
    assert pruned.explanations[ReplicaId("r0003")].filtered_out_by == "serves-model"
    nobody = [copy_with(r, healthy=False) for r in many]
    with pytest.raises(NoReplicaAvailable, match="no replica can serve"):
        await decide(nobody, request({}, 40, 7), Pruning(64, 8))


async def test_flow_controls_estimate_reads_the_scored_replicas_of_a_pruned_decision() -> None:
    """The estimate reads the candidates' queue waits: the scored ones, not every explanation
    of a large fleet (building 200 explanations to skip 192 pruned ones)."""
    from routing.flow_control import estimate_from_decision

    replicas = [replica(i, i % 9) for i in range(200)]
    decision = await decide(replicas, request({}, 40, 3), Pruning(64, 8))
    estimate = estimate_from_decision(decision, replicas)
    scored = [rid for rid, e in decision.explanations.items() if e.filtered_out_by is None]
    assert [rid for rid, _ in decision.explanations.scored()] == sorted(scored)  # fleet order
    assert len(estimate.loads) == len(scored) == 8
    waits = sorted(decision.explanations[rid].terms["queue_wait_ms"] for rid in scored)
    assert sorted(load.queue_wait_ms for load in estimate.loads) == waits
