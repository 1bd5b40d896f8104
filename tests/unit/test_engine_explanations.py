"""Decision explanations are built lazily, yet read exactly like the dict built stage by stage.

``ExplanationMap`` is a read-only ``Mapping``: these tests pin every way its readers use it
(``[]``, ``get``, ``in``, ``len``, iteration, ``items``/``values``, equality, copies, JSON).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

import routing.engine as engine_module
from routing.contracts import ReplicaExplanation, RoutingDecision, RoutingRequest
from routing.engine import ExplanationMap, Profile, RoutingEngine
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId

MODEL = "base-model"
A, B, C, D = ReplicaId("a"), ReplicaId("b"), ReplicaId("c"), ReplicaId("d")


def rep(rid: str, **fields: Any) -> ReplicaState:
    fields.setdefault("models", frozenset({MODEL}))
    return ReplicaState(replica_id=ReplicaId(rid), url=f"http://{rid}", **fields)


def req() -> RoutingRequest:
    return RoutingRequest(
        request_id="r1",
        model=MODEL,
        adapter=None,
        tenant="t",
        route="default",
        prompt_tokens=320,
        chain=[BlockHash(i) for i in range(20)],
        seed=7,
    )


class DropC:
    type_name = name = "drop-c"

    def filter(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> list:
        return [r for r in replicas if r.replica_id != C]


class TermsScorer:
    """Scores with terms, including one out-of-range score the engine clamps."""

    type_name = name = "terms"

    def score_with_terms(self, request, replicas):
        scores = {A: 0.5, B: 2.0}
        terms = {A: {"cost_ms": 10.0, "load": 99.0}, B: {"cost_ms": 20.0}}
        return scores, terms

    def score(self, request, replicas):
        return self.score_with_terms(request, replicas)[0]


class PlainScorer:
    type_name = name = "plain"

    def score(self, request, replicas):
        return {A: float("nan"), B: 0.25}


class TermsPicker:
    type_name = name = "terms-picker"

    def pick_with_terms(self, request, replicas, scores):
        order = sorted(scores, key=lambda rid: -scores[rid])
        return order, {A: {"picked_rank": 1.0}, C: {"seen_filtered": 1.0}}

    def pick(self, request, replicas, scores):
        return self.pick_with_terms(request, replicas, scores)[0]


def profile() -> Profile:
    return Profile(
        name="p",
        filters=(DropC(),),
        scorers=((TermsScorer(), 1.0), (PlainScorer(), 2.0)),
        picker=TermsPicker(),
    )


#: What the engine used to build eagerly, stage by stage, for ``decide()``.
EXPECTED = {
    A: ReplicaExplanation(
        replica=A,
        matched_blocks=4,
        scores={"terms": 0.5, "plain": 0.0},
        terms={"load": 99.0, "cost_ms": 10.0, "picked_rank": 1.0},
    ),
    B: ReplicaExplanation(
        replica=B,
        matched_blocks=0,
        scores={"terms": 1.0, "plain": 0.25},
        terms={"load": 3.0, "cost_ms": 20.0},
    ),
    C: ReplicaExplanation(
        replica=C,
        matched_blocks=2,
        terms={"load": 0.0, "seen_filtered": 1.0},
        filtered_out_by="drop-c",
    ),
    D: ReplicaExplanation(replica=D, terms={"load": 0.0}, filtered_out_by="serves-model"),
}


async def decide() -> tuple[RoutingDecision, list[ReplicaState]]:
    replicas = [rep("a", running=1), rep("b", running=3), rep("c"), rep("d", healthy=False)]
    request = req()
    request.prefix_matches = {A: 4, C: 2}
    decision = await RoutingEngine(None, {"p": profile()}).route(request, replicas, "p")
    return decision, replicas


async def test_explanations_hold_what_every_stage_reported() -> None:
    decision, _ = await decide()
    assert (decision.replica, decision.fallbacks) == (B, [A])
    explanations = decision.explanations
    assert isinstance(explanations, Mapping) and isinstance(explanations, ExplanationMap)
    assert list(explanations) == [A, B, C, D]
    for rid, expected in EXPECTED.items():
        assert explanations[rid] == expected
        # Same key order as the eager build: load, scorer terms in order, then picker terms.
        assert list(explanations[rid].terms) == list(expected.terms)
        assert list(explanations[rid].scores) == list(expected.scores)
    assert explanations == EXPECTED


async def test_comparisons_build_what_they_compare() -> None:
    # Each comparison on a fresh decision, nothing read before: a plain dict on either side.
    assert (await decide())[0].explanations == EXPECTED
    assert EXPECTED == (await decide())[0].explanations  # noqa: SIM300
    assert ((await decide())[0].explanations != EXPECTED) is False
    assert (EXPECTED != (await decide())[0].explanations) is False  # noqa: SIM300
    first, second = (await decide())[0], (await decide())[0]
    assert first.explanations == second.explanations


async def test_reading_one_replica_builds_only_that_one(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[ReplicaId] = []
    explain = engine_module._Stages.explain

    def counting(self: Any, replica: ReplicaId, load: float) -> ReplicaExplanation:
        built.append(replica)
        return explain(self, replica, load)

    monkeypatch.setattr(engine_module._Stages, "explain", counting)
    decision, _ = await decide()
    explanations = decision.explanations
    assert built == []  # routing built none
    assert (len(explanations), A in explanations, list(explanations)) == (4, True, [A, B, C, D])
    assert list(explanations.keys()) == [A, B, C, D] and built == []
    assert explanations.get(B) == EXPECTED[B] and explanations[B] == EXPECTED[B]
    assert built == [B]  # built once, then kept
    assert explanations.get(ReplicaId("zz")) is None and built == [B]
    with pytest.raises(KeyError):
        explanations[ReplicaId("zz")]
    assert dict(explanations.items()) == EXPECTED
    assert sorted(built) == [A, B, C, D]


async def test_loads_are_those_at_decision_time() -> None:
    decision, replicas = await decide()
    replicas[1].inflight_requests = 50  # the gateway counts the request it just routed
    assert decision.explanations[B].terms["load"] == 3.0


@pytest.mark.parametrize(
    "convert",
    [
        dict,
        lambda m: {**m},
        copy.copy,
        copy.deepcopy,
        lambda m: pickle.loads(pickle.dumps(m)),
        lambda m: dict(m.items()),
        lambda m: dict(zip(m.keys(), m.values(), strict=True)),
    ],
)
async def test_copies_hold_built_explanations(convert: Any) -> None:
    decision, _ = await decide()
    copied = convert(decision.explanations)
    assert copied == EXPECTED
    assert type(copied) is dict
    assert all(type(value) is ReplicaExplanation for value in copied.values())


async def test_serialising_sees_every_explanation() -> None:
    # dataclasses.asdict deep-copies a non-dict mapping: a plain dict of the explanations.
    decision, _ = await decide()
    assert dataclasses.asdict(decision)["explanations"] == EXPECTED
    decision, _ = await decide()
    rendered = {rid: dataclasses.asdict(e) for rid, e in decision.explanations.items()}
    text = json.dumps(rendered)
    assert json.loads(text)["a"]["terms"] == EXPECTED[A].terms
    decision, _ = await decide()
    assert repr(decision.explanations) == repr(EXPECTED)


async def test_it_cannot_be_written() -> None:
    decision, _ = await decide()
    explanations = decision.explanations
    with pytest.raises(TypeError):
        explanations[A] = ReplicaExplanation(replica=A)  # type: ignore[index]
    with pytest.raises(TypeError):
        del explanations[A]  # type: ignore[attr-defined]
    for method in ("update", "pop", "setdefault", "popitem", "clear"):
        assert not hasattr(explanations, method), method
    assert explanations == EXPECTED  # unchanged


async def test_the_decision_record_renders_every_explanation() -> None:
    # The reader behind /admin/decisions (gateway/request/record.py).
    from gateway.request.record import DecisionRecord

    decision, _ = await decide()
    fields = {f.name: None for f in dataclasses.fields(DecisionRecord)}
    fields.update(
        at=0.0,
        request_id="r",
        route="/v1/completions",
        tenant="t",
        model=MODEL,
        adapter=None,
        prompt_tokens=8,
        blocks=0,
        replica=decision.replica,
        fallbacks=(),
        profile="p",
        degraded=False,
        last_resort=False,
        timings_ms={},
        explanations=decision.explanations,
        status=200,
    )
    rendered = DecisionRecord(**fields).as_json()["explanations"]
    assert list(rendered) == [A, B, C, D]
    assert rendered[C] == {
        "matched_blocks": 2,
        "scores": {},
        "terms": {"load": 0.0, "seen_filtered": 1.0},
        "filtered_out_by": "drop-c",
    }
