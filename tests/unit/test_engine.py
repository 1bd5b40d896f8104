"""The policy engine: filtering, the one index lookup, degrading, weighting, timing, feedback."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from routing.contracts import (
    IndexUnavailable,
    NoReplicaAvailable,
    RoutingRequest,
)
from routing.engine import Profile, RoutingEngine
from routing.policies.least_loaded import LeastLoadedPicker
from routing.policies.registry import builtin_profile, builtin_profiles
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId

MODEL = "base-model"


def rep(rid: str, **fields: Any) -> ReplicaState:
    fields.setdefault("models", frozenset({MODEL}))
    return ReplicaState(replica_id=ReplicaId(rid), url=f"http://{rid}", **fields)


def req(**fields: Any) -> RoutingRequest:
    values: dict[str, Any] = {
        "request_id": "r1",
        "model": MODEL,
        "adapter": None,
        "tenant": "t",
        "route": "default",
        "prompt_tokens": 320,
        "chain": [BlockHash(i) for i in range(20)],
        "seed": 7,
    }
    values.update(fields)
    return RoutingRequest(**values)


class FakeIndex:
    """Answers ``match`` with fixed matches, or fails the way a test asks it to."""

    def __init__(
        self, matches: Mapping[str, int] | None = None, error: BaseException | None = None
    ) -> None:
        self.matches = {ReplicaId(k): v for k, v in (matches or {}).items()}
        self.error = error
        self.hang = asyncio.Event()  # never set: a lookup that waits here times out
        self.hanging = False
        self.calls: list[Sequence[BlockHash]] = []

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        self.calls.append(chain)
        if self.hanging:
            await self.hang.wait()
        if self.error is not None:
            raise self.error
        return dict(self.matches)


class ConstScorer:
    """A scorer returning fixed raw values (possibly out of range) for the engine to clamp."""

    def __init__(self, name: str, values: Mapping[str, float]) -> None:
        self.type_name = "const"
        self.name = name
        self.values = values

    def score(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> dict:
        values = self.values
        return {r.replica_id: values[r.replica_id] for r in replicas if r.replica_id in values}


class RecordingPicker:
    """Returns a fixed order and records the weighted scores it was given."""

    type_name = "recording"

    def __init__(self, order: list[str] | None = None, error: Exception | None = None) -> None:
        self.order = order
        self.error = error
        self.seen: dict[ReplicaId, float] = {}

    def pick(self, request, replicas, scores) -> list[ReplicaId]:
        self.seen = dict(scores)
        if self.error is not None:
            raise self.error
        if self.order is None:
            return sorted(r.replica_id for r in replicas)
        return [ReplicaId(x) for x in self.order]


class DropAll:
    type_name = "drop-all"

    def filter(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> list:
        return []


def engine_with(profile: Profile, index: Any = None, **kwargs: Any) -> RoutingEngine:
    return RoutingEngine(index, {profile.name: profile}, **kwargs)


# --------------------------------------------------------------------------- filtering


async def test_builtin_filter_drops_unhealthy_and_wrong_model_and_explains_why() -> None:
    replicas = [
        rep("a", healthy=False),
        rep("b", models=frozenset({"other"})),
        rep("c", running=5),
        rep("d", running=1),
    ]
    engine = engine_with(builtin_profile("least-loaded"))
    decision = await engine.route(req(), replicas, "least-loaded")
    assert (decision.replica, decision.fallbacks) == ("d", ["c"])
    assert decision.explanations[ReplicaId("a")].filtered_out_by == "serves-model"
    assert decision.explanations[ReplicaId("b")].filtered_out_by == "serves-model"
    assert decision.explanations[ReplicaId("c")].filtered_out_by is None


@pytest.mark.parametrize(
    ("replicas", "filters", "message"),
    [
        ([], (), "no replicas are registered"),
        ([rep("a", healthy=False)], (), "0 healthy"),
        ([rep("a", models=frozenset({"x"}))], (), "0 healthy with the model"),
        ([rep("a")], (DropAll(),), "'drop-all'"),
    ],
)
async def test_no_replica_available_only_when_filtering_leaves_none(
    replicas: list[ReplicaState], filters: tuple, message: str
) -> None:
    profile = Profile(name="p", filters=filters, scorers=(), picker=LeastLoadedPicker())
    with pytest.raises(NoReplicaAvailable, match=message):
        await engine_with(profile).route(req(), replicas, "p")


async def test_unknown_profile_is_a_clear_error() -> None:
    engine = engine_with(builtin_profile("random"))
    with pytest.raises(ValueError, match="unknown routing profile 'nope' \\(known: random\\)"):
        await engine.route(req(), [rep("a")], "nope")


# --------------------------------------------------------------------------- index lookup


async def test_index_is_consulted_once_and_only_for_profiles_that_need_prefix() -> None:
    index = FakeIndex({"a": 15, "b": 3})
    engine = RoutingEngine(index, builtin_profiles())
    replicas = [rep("a"), rep("b"), rep("c")]

    request = req()
    decision = await engine.route(request, replicas, "round-robin")
    assert index.calls == [] and request.prefix_matches is None and not decision.degraded

    request = req()
    decision = await engine.route(request, replicas, "expected-ttft")
    assert len(index.calls) == 1
    assert request.prefix_matches == {"a": 15, "b": 3}
    assert decision.replica == "a" and not decision.degraded
    blocks = {rid: e.matched_blocks for rid, e in decision.explanations.items()}
    assert blocks == {"a": 15, "b": 3, "c": 0}
    assert "index" in decision.timings_ms


async def test_empty_chain_needs_no_lookup() -> None:
    index = FakeIndex(error=IndexUnavailable("down"))
    request = req(chain=[], prompt_tokens=5)
    decision = await engine_with(builtin_profile("expected-ttft"), index).route(
        request, [rep("a")], "expected-ttft"
    )
    assert index.calls == [] and request.prefix_matches == {} and not decision.degraded


@pytest.mark.parametrize(
    "failure",
    ["unavailable", "bug", "timeout"],
)
async def test_index_failure_degrades_to_load_only_and_never_fails(failure: str) -> None:
    index = FakeIndex({"busy": 400})
    if failure == "unavailable":
        index.error = IndexUnavailable("redis down")
    elif failure == "bug":
        index.error = KeyError("oops")
    else:
        index.hanging = True
    engine = engine_with(builtin_profile("expected-ttft"), index, index_timeout_s=0.01)
    # "busy" holds the whole 400-block prompt behind a 200 ms queue; "idle" holds nothing. With the
    # index "busy" wins (200 ms vs 640 ms of prefill); load-only routing must not believe any
    # cached prefix, caller-supplied or stale, so it sends to the idle one.
    replicas = [rep("busy", inflight_prefill_tokens=2_000, inflight_requests=1), rep("idle")]
    chain = [BlockHash(i) for i in range(400)]
    request = req(chain=chain, prompt_tokens=6_400, prefix_matches={ReplicaId("busy"): 400})
    decision = await engine.route(request, replicas, "expected-ttft")
    assert decision.degraded
    assert request.prefix_matches is None
    assert decision.replica == "idle"
    assert all(e.matched_blocks == 0 for e in decision.explanations.values())


async def test_same_setup_with_a_working_index_prefers_the_cached_replica() -> None:
    """The control for the degraded test above: it shows that test could fail."""
    engine = engine_with(builtin_profile("expected-ttft"), FakeIndex({"busy": 400}))
    replicas = [rep("busy", inflight_prefill_tokens=2_000, inflight_requests=1), rep("idle")]
    chain = [BlockHash(i) for i in range(400)]
    decision = await engine.route(req(chain=chain, prompt_tokens=6_400), replicas, "expected-ttft")
    assert decision.replica == "busy" and not decision.degraded


async def test_without_an_index_caller_supplied_matches_are_used() -> None:
    engine = engine_with(builtin_profile("cache-aware"), None)
    request = req(prefix_matches={ReplicaId("b"): 20})
    decision = await engine.route(request, [rep("a"), rep("b")], "cache-aware")
    assert decision.replica == "b" and not decision.degraded
    decision = await engine.route(req(), [rep("a"), rep("b")], "cache-aware")
    assert decision.degraded  # needs prefix data, has none


# --------------------------------------------------------------------------- scoring


async def test_scores_are_clamped_then_weighted_then_summed() -> None:
    picker = RecordingPicker()
    profile = Profile(
        name="p",
        filters=(),
        scorers=(
            (ConstScorer("s1", {"a": 2.0, "b": -1.0, "c": math.nan}), 2.0),
            (ConstScorer("s2", {"a": 0.5, "b": 0.25}), 0.5),
        ),
        picker=picker,
    )
    decision = await engine_with(profile).route(req(), [rep("a"), rep("b"), rep("c")], "p")
    assert picker.seen == {"a": 2.0 * 1.0 + 0.5 * 0.5, "b": 0.5 * 0.25, "c": 0.0}
    assert decision.explanations[ReplicaId("a")].scores == {"s1": 1.0, "s2": 0.5}
    assert decision.explanations[ReplicaId("c")].scores == {"s1": 0.0, "s2": 0.0}
    assert set(decision.timings_ms) == {
        "filter:serves-model",
        "scorer:s1",
        "scorer:s2",
        "picker:recording",
        "total",
    }
    assert all(v >= 0 for v in decision.timings_ms.values())


async def test_failing_scorer_gives_no_opinion_and_routing_continues() -> None:
    class Broken:
        type_name = name = "broken"

        def score(self, request, replicas):
            raise ZeroDivisionError

    picker = RecordingPicker()
    profile = Profile(
        name="p",
        filters=(),
        scorers=((Broken(), 1.0), (ConstScorer("ok", {"a": 1.0, "b": 0.5}), 1.0)),
        picker=picker,
    )
    decision = await engine_with(profile).route(req(), [rep("a"), rep("b")], "p")
    assert picker.seen == {"a": 1.0, "b": 0.5}
    assert decision.explanations[ReplicaId("a")].scores["broken"] == 0.0


@pytest.mark.parametrize(
    ("order", "error", "expected"),
    [
        (["b", "zz", "b", "a"], None, ["b", "a"]),  # unknown and repeated ids dropped
        ([], None, ["a", "b"]),  # nothing usable: by weighted score
        (None, RuntimeError("bug"), ["a", "b"]),
    ],
)
async def test_picker_output_is_sanitised(
    order: list[str] | None, error: Exception | None, expected: list[str]
) -> None:
    profile = Profile(
        name="p",
        filters=(),
        scorers=((ConstScorer("s", {"a": 0.9, "b": 0.1}), 1.0),),
        picker=RecordingPicker(order, error),
    )
    decision = await engine_with(profile).route(req(), [rep("a"), rep("b")], "p")
    assert [decision.replica, *decision.fallbacks] == expected


async def test_expected_ttft_decisions_explain_every_cost_term() -> None:
    engine = engine_with(builtin_profile("expected-ttft"), FakeIndex({"a": 10}))
    decision = await engine.route(req(), [rep("a"), rep("b", running=2)], "expected-ttft")
    for explanation in decision.explanations.values():
        assert {
            "load",
            "queue_wait_ms",
            "prefill_ms",
            "uncached_tokens",
            "adapter_cold_load_ms",
            "kv_penalty_ms",
            "stale_penalty_ms",
            "expected_ttft_ms",
            "over_load_bound",
        } <= set(explanation.terms)
    assert decision.explanations[ReplicaId("a")].terms["uncached_tokens"] == 320 - 10 * 16


# --------------------------------------------------------------------------- profiles


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "non-empty"),
        ({"scorers": ((ConstScorer("s", {}), -1.0),)}, "weight of scorer 's'"),
        ({"scorers": ((ConstScorer("s", {}), math.inf),)}, "finite"),
        ({"scorers": ((ConstScorer("s", {}), 1), (ConstScorer("s", {}), 1))}, "used twice"),
        ({"picker": DropAll()}, "not a picker"),
        ({"filters": (LeastLoadedPicker(),)}, "not a filter"),
    ],
)
def test_profile_validates_on_construction(kwargs: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {
        "name": "p",
        "filters": (),
        "scorers": (),
        "picker": RecordingPicker(),
    }
    values.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        Profile(**values)


def test_engine_rejects_profiles_filed_under_another_name() -> None:
    with pytest.raises(ValueError, match="holds a profile named 'random'"):
        RoutingEngine(None, {"other": builtin_profile("random")})
    with pytest.raises(ValueError, match="index_timeout_s"):
        RoutingEngine(None, {}, index_timeout_s=0)


# --------------------------------------------------------------------------- feedback


class Observer:
    type_name = name = "observer"

    def __init__(self, fail: bool = False) -> None:
        self.events: list[tuple] = []
        self.fail = fail

    def score(self, request, replicas):
        return {}

    def on_request_start(self, request: RoutingRequest, replica: ReplicaId) -> None:
        self.events.append(("start", request.request_id, replica))
        if self.fail:
            raise RuntimeError("observer bug")

    def on_request_complete(self, request, replica, ttft_ms, cached_tokens, ok) -> None:
        self.events.append(("complete", request.request_id, replica, ttft_ms, cached_tokens, ok))
        if self.fail:
            raise RuntimeError("observer bug")


def test_observations_reach_each_observer_once_and_failures_stay_inside() -> None:
    shared, failing = Observer(), Observer(fail=True)
    failing.name = "failing"
    p1 = Profile(name="p1", filters=(), scorers=((shared, 1.0),), picker=RecordingPicker())
    p2 = Profile(
        name="p2", filters=(), scorers=((shared, 1.0), (failing, 1.0)), picker=RecordingPicker()
    )
    engine = RoutingEngine(None, {"p1": p1, "p2": p2})
    request = req()
    engine.observe_start(request, ReplicaId("a"))
    engine.observe_complete(request, ReplicaId("a"), 12.5, 64, True)
    expected = [("start", "r1", "a"), ("complete", "r1", "a", 12.5, 64, True)]
    assert shared.events == expected
    assert failing.events == expected
