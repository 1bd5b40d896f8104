"""``consistent-hash``: prefix-keyed ring with bounded loads."""

from __future__ import annotations

from collections import Counter

from routing.contracts import RoutingRequest
from routing.policies.consistent_hash import ConsistentHashPicker
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId

IDS = [f"r{i}" for i in range(8)]


def rep(rid: str, load: int = 0) -> ReplicaState:
    return ReplicaState(
        replica_id=ReplicaId(rid), url=f"http://{rid}", models=frozenset({"m"}), running=load
    )


def req(chain: list[int], request_id: str = "r") -> RoutingRequest:
    return RoutingRequest(
        request_id=request_id, model="m", adapter=None, tenant="t", route="d",
        prompt_tokens=16 * len(chain), chain=[BlockHash(h) for h in chain],
    )


def chain_for(prefix: int, length: int = 12, suffix: int = 0) -> list[int]:
    """A chain whose first 8 blocks depend on ``prefix`` only (like a chained hash would)."""
    return [prefix * 1_000 + i for i in range(8)] + [suffix * 1_000 + i for i in range(length - 8)]


def owner(picker: ConsistentHashPicker, chain: list[int], replicas: list[ReplicaState]) -> str:
    return picker.pick(req(chain), replicas, {})[0]


def test_same_prefix_same_replica_different_suffixes_included() -> None:
    picker = ConsistentHashPicker()
    replicas = [rep(x) for x in IDS]
    owners = {owner(picker, chain_for(7, suffix=s), replicas) for s in range(20)}
    assert len(owners) == 1


def test_distinct_prefixes_spread_over_the_ring() -> None:
    picker = ConsistentHashPicker()
    replicas = [rep(x) for x in IDS]
    counts = Counter(owner(picker, chain_for(p), replicas) for p in range(400))
    assert set(counts) == set(IDS)
    assert max(counts.values()) < 2.5 * 400 / len(IDS)


def test_overloaded_owner_is_skipped_for_the_next_on_the_ring() -> None:
    picker = ConsistentHashPicker(ConsistentHashPicker.Params(load_epsilon=0.25))
    idle = [rep(x) for x in IDS]
    walk = picker.pick(req(chain_for(3)), idle, {})
    # The owner carries 10 of 10 requests: bound = ceil(1.25 x 11 / 8) = 2, so it is skipped.
    loaded = [rep(x, 10 if x == walk[0] else 0) for x in IDS]
    order, terms = picker.pick_with_terms(req(chain_for(3)), loaded, {})
    assert order[0] == walk[1]
    assert order[1:] == [walk[0], *walk[2:]]
    assert terms[ReplicaId(walk[0])]["over_load_bound"] == 1.0
    assert terms[ReplicaId(walk[1])]["ring_rank"] == 1.0


def test_removing_a_replica_moves_only_its_own_keys() -> None:
    picker = ConsistentHashPicker()
    full = [rep(x) for x in IDS]
    before = {p: owner(picker, chain_for(p), full) for p in range(200)}
    without = [r for r in full if r.replica_id != "r3"]
    after = {p: owner(picker, chain_for(p), without) for p in range(200)}
    moved = {p for p in before if before[p] != after[p]}
    assert moved == {p for p in before if before[p] == "r3"}
    assert moved  # r3 owned something, so the check above had something to check


def test_key_uses_first_k_blocks_and_short_chains_fall_back() -> None:
    picker = ConsistentHashPicker(ConsistentHashPicker.Params(prefix_blocks=4))
    assert picker.key(req([10, 11, 12, 13, 14, 15])) == picker.key(req([9, 9, 9, 13]))
    assert picker.key(req([10, 11, 12, 13, 14, 15])) != picker.key(req([10, 11, 12, 14]))
    assert picker.key(req([10, 11])) == picker.key(req([11]))
    assert picker.key(req([], "a")) != picker.key(req([], "b"))
