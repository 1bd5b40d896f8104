"""``max-score``: best weighted score under a bounded-load guard, near-ties shared in turns."""

from __future__ import annotations

import dataclasses
from collections import Counter
from itertools import pairwise

from routing.contracts import RoutingRequest
from routing.policies.max_score import MaxScorePicker
from routing.state import ReplicaState
from routing.types import ReplicaId


def rep(rid: str, load: int = 0) -> ReplicaState:
    return ReplicaState(
        replica_id=ReplicaId(rid), url=f"http://{rid}", models=frozenset({"m"}), running=load
    )


def req(seed: int) -> RoutingRequest:
    return RoutingRequest(
        request_id="r", model="m", adapter=None, tenant="t", route="d", prompt_tokens=1, seed=seed
    )


def scores(**values: float) -> dict[ReplicaId, float]:
    return {ReplicaId(k): v for k, v in values.items()}


def test_highest_score_wins_and_the_rest_follow_by_score() -> None:
    picker = MaxScorePicker(MaxScorePicker.Params(tie_tolerance=0.0))
    replicas = [rep("a"), rep("b"), rep("c")]
    assert picker.pick(req(1), replicas, scores(a=0.2, b=0.9, c=0.5)) == ["b", "c", "a"]


def test_near_ties_are_shared_and_clear_losers_never_win() -> None:
    picker = MaxScorePicker(MaxScorePicker.Params(tie_tolerance=0.05))
    replicas = [rep("a"), rep("b"), rep("c")]
    given = scores(a=1.0, b=0.96, c=0.90)
    firsts = Counter(picker.pick(req(s), replicas, given)[0] for s in range(200))
    assert set(firsts) == {"a", "b"}
    assert min(firsts.values()) > 50


def test_bounded_load_guard_passes_over_an_overloaded_favourite() -> None:
    picker = MaxScorePicker(MaxScorePicker.Params(load_epsilon=0.25, load_slack=2.0))
    # mean load 5; bound 1.25 x 5 + 2 = 8.25: "hot" (12) is not eligible, however good its score.
    replicas = [rep("hot", 12), rep("b", 3), rep("c", 0)]
    order, terms = picker.pick_with_terms(req(1), replicas, scores(hot=1.0, b=0.5, c=0.1))
    assert order == ["b", "c", "hot"]
    assert terms[ReplicaId("hot")]["over_load_bound"] == 1.0
    assert terms[ReplicaId("b")]["over_load_bound"] == 0.0


def test_a_queue_of_cache_hits_is_spared_the_load_bound_when_asked() -> None:
    """Many requests waiting but few prompt tokens left to prefill: the holder's queue is its
    own cache hits. Passing it over would prefill their prefix again elsewhere."""

    def with_pending(state: ReplicaState, tokens: int) -> ReplicaState:
        state.inflight_prefill_tokens = tokens
        return state

    # mean load 5, bound 8.25: "hot" (12) is over it. Mean pending prefill 4,000 tokens.
    replicas = [
        with_pending(rep("hot", 12), 1_000),
        with_pending(rep("b", 3), 6_000),
        with_pending(rep("c", 0), 5_000),
    ]
    given = scores(hot=1.0, b=0.5, c=0.1)
    plain = MaxScorePicker(MaxScorePicker.Params(load_epsilon=0.25, load_slack=2.0))
    assert plain.pick(req(1), replicas, given)[0] == "b"
    sparing = MaxScorePicker(
        MaxScorePicker.Params(load_epsilon=0.25, load_slack=2.0, spare_cached_queues=True)
    )
    order, terms = sparing.pick_with_terms(req(1), replicas, given)
    assert order[0] == "hot" and terms[ReplicaId("hot")]["over_load_bound"] == 0.0
    # The same queue with more than the mean left to prefill is work, and it is passed over.
    replicas[0] = with_pending(rep("hot", 12), 9_000)
    order, terms = sparing.pick_with_terms(req(1), replicas, given)
    assert order == ["b", "c", "hot"] and terms[ReplicaId("hot")]["over_load_bound"] == 1.0


def test_a_replica_running_the_requests_adapter_stays_eligible_over_the_bound() -> None:
    """There the request shares the GPU LoRA slot its adapter holds; elsewhere it would take
    one of the few slots or wait for one, which the scorer prices (b2b-lora: passing holders over
    spread each popular adapter over three replicas' slots and starved the tail adapters)."""
    replicas = [
        dataclasses.replace(rep("holder", 12), running_adapters=frozenset({"ft-00", "ft-07"})),
        rep("b", 3),
        rep("c", 0),
    ]
    given = scores(holder=1.0, b=0.5, c=0.1)

    def for_adapter(adapter: str | None) -> RoutingRequest:
        request = req(1)
        request.adapter = adapter
        return request

    plain = MaxScorePicker(MaxScorePicker.Params(load_epsilon=0.25, load_slack=2.0))
    assert plain.pick(for_adapter("ft-00"), replicas, given)[0] == "b"
    sparing = MaxScorePicker(
        MaxScorePicker.Params(load_epsilon=0.25, load_slack=2.0, spare_adapter_holders=True)
    )
    order, terms = sparing.pick_with_terms(for_adapter("ft-00"), replicas, given)
    assert order[0] == "holder" and terms[ReplicaId("holder")]["over_load_bound"] == 0.0
    # Another adapter, or none, gains nothing there: the bound holds.
    for other in ("ft-01", None):
        order, terms = sparing.pick_with_terms(for_adapter(other), replicas, given)
        assert order == ["b", "c", "holder"]
        assert terms[ReplicaId("holder")]["over_load_bound"] == 1.0


def test_an_overflow_request_goes_where_its_scorer_sent_it_over_the_bound() -> None:
    """A scorer that judged the request late everywhere concentrates it on purpose."""
    picker = MaxScorePicker(MaxScorePicker.Params(load_epsilon=0.25, load_slack=2.0))
    replicas = [rep("sink", 12), rep("b", 3), rep("c", 0)]
    request = req(1)
    request.overflow = True
    order, terms = picker.pick_with_terms(request, replicas, scores(sink=1.0, b=0.5, c=0.1))
    assert order == ["sink", "b", "c"]
    assert all(t["over_load_bound"] == 0.0 for t in terms.values())


def test_same_seed_same_answer() -> None:
    replicas = [rep(x) for x in "abcd"]
    equal = scores(a=1, b=1, c=1, d=1)
    for tie_break in ("least-recent", "random"):
        params = MaxScorePicker.Params(tie_break=tie_break)
        first = MaxScorePicker(params).pick(req(9), replicas, equal)
        assert first == MaxScorePicker(params).pick(req(9), replicas[::-1], equal)


def test_near_ties_take_turns_whatever_the_seed() -> None:
    """Eight new prefixes on two idle replicas (every score equal): 4 and 4, never 6 and 2."""
    picker = MaxScorePicker(MaxScorePicker.Params(tie_tolerance=0.01))
    replicas = [rep("r0"), rep("r1")]
    for start in range(20):
        firsts = Counter(
            picker.pick(req(start * 100 + k), replicas, scores(r0=1.0, r1=1.0))[0]
            for k in range(8)
        )
        assert firsts == {"r0": 4, "r1": 4}


def test_turns_go_to_the_least_recently_chosen_among_the_near_ones_only() -> None:
    picker = MaxScorePicker(MaxScorePicker.Params(tie_tolerance=0.05))
    replicas = [rep("a"), rep("b"), rep("c")]
    near_ab = scores(a=1.0, b=0.97, c=0.5)
    chosen = [picker.pick(req(k), replicas, near_ab)[0] for k in range(6)]
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
    assert all(x != y for x, y in pairwise(chosen))  # alternating
    # c was never chosen, but it is no tie: a clear loser does not get a turn.
    assert picker.pick(req(7), replicas, scores(a=1.0, b=1.0, c=0.9))[0] != "c"
    # Now it is one: never chosen, it goes first.
    assert picker.pick(req(8), replicas, scores(a=1.0, b=1.0, c=1.0))[0] == "c"
