"""The gateway's flow gate driven directly (no sockets): pools, a failing re-route, reloads,
budgets. The request path around it is covered on real sockets in
tests/integration/test_flow_control_gateway.py."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from gateway.errors import GatewayError
from gateway.flow_control import FlowGate
from gateway.metrics import GatewayMetrics
from routing.config import Policy
from routing.config.loader import parse_policy
from routing.contracts import ReplicaExplanation, RoutingDecision, RoutingRequest
from routing.flow_control import BudgetReservation
from routing.state import ReplicaState
from routing.types import ReplicaId

#: Long enough for anything the pump does in these tests; a hang fails instead of blocking CI.
PATIENCE_S = 10.0


def _policy(enabled: bool = True) -> Policy:
    sha = hashlib.sha256(b"t").hexdigest()
    return parse_policy(
        f"""
version: 1
replica_pools:
  - {{name: pool-a, replicas: ["http://a1", "http://a2"]}}
  - {{name: pool-b, replicas: ["http://b1", "http://b2"]}}
models:
  - {{name: model-a, pools: [pool-a]}}
  - {{name: model-b, pools: [pool-b]}}
flow_control:
  enabled: {str(enabled).lower()}
  max_queue_wait_ms: 600000
tenants:
  - name: t
    api_key_sha256: [{sha}]
    token_budget: {{prompt_tokens_per_minute: 100}}
"""
    )


@dataclass(frozen=True)
class _Route:
    name: str = "all"
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None


@dataclass(frozen=True)
class _Tenant:
    name: str = "t"


@dataclass(frozen=True)
class _Routed:
    """The fields of the gateway's ``RouteDecision`` that flow control reads."""

    routing_request: RoutingRequest
    decision: RoutingDecision
    tenant: _Tenant = field(default_factory=_Tenant)
    route: _Route = field(default_factory=_Route)
    budget_prompt_tokens: int = 0
    budget_reserved: BudgetReservation | None = None
    prompt_counted: bool = True


def _routed(
    request_id: str,
    model: str,
    replicas: list[str],
    prompt_tokens: int = 10,
    budget_prompt_tokens: int | None = None,
) -> _Routed:
    ids = [ReplicaId(r) for r in replicas]
    terms = {"queue_wait_ms": 100.0, "expected_ttft_ms": 300.0}
    decision = RoutingDecision(
        replica=ids[0],
        fallbacks=ids[1:],
        profile="p",
        degraded=False,
        explanations={r: ReplicaExplanation(r, terms=dict(terms)) for r in ids},
    )
    request = RoutingRequest(
        request_id=request_id,
        model=model,
        adapter=None,
        tenant="t",
        route="all",
        prompt_tokens=prompt_tokens,
    )
    budget = prompt_tokens if budget_prompt_tokens is None else budget_prompt_tokens
    return _Routed(request, decision, budget_prompt_tokens=budget)


def _states(model_a_waiting: int) -> list[ReplicaState]:
    """model-a's two replicas with ``model_a_waiting`` requests in their queues; model-b's idle."""
    return [
        ReplicaState(ReplicaId("a1"), "http://a1", waiting=model_a_waiting),
        ReplicaState(ReplicaId("a2"), "http://a2", waiting=model_a_waiting),
        ReplicaState(ReplicaId("b1"), "http://b1"),
        ReplicaState(ReplicaId("b2"), "http://b2"),
    ]


async def _unchanged(routed: _Routed, only: object = None) -> _Routed:
    return routed


class _Gate:
    """A flow gate with its pump running, over a fleet and a policy the test can change."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.states = _states(model_a_waiting=5)  # model-a saturated
        self.metrics = GatewayMetrics()
        self.gate = FlowGate(
            self.metrics, replica_states=lambda: self.states, policy=lambda: self.policy
        )
        self.pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Gate:
        self.pump = asyncio.create_task(self.gate.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.pump is not None
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)

    def admit(
        self,
        routed: _Routed,
        repick: Callable[..., Awaitable[_Routed]] = _unchanged,
    ) -> asyncio.Task[_Routed]:
        return asyncio.create_task(self.gate.admit(routed, {}, self.policy, repick))

    async def queued(self, count: int) -> None:
        """Until ``count`` requests wait in the queue (admission runs as a task)."""
        async with asyncio.timeout(PATIENCE_S):
            while len(self.gate.controller.queue) != count:
                await asyncio.sleep(0)

    def free_model_a(self) -> None:
        self.states = _states(model_a_waiting=0)
        self.gate.request_finished(None, "t", None)  # what a finished request does: wake up


async def test_a_request_for_an_idle_model_never_waits_behind_a_saturated_one() -> None:
    async with _Gate(_policy()) as fleet:
        held = fleet.admit(_routed("a-1", "model-a", ["a1", "a2"]))
        await fleet.queued(1)
        async with asyncio.timeout(PATIENCE_S):
            admitted = await fleet.admit(_routed("b-1", "model-b", ["b1", "b2"]))
        assert admitted.routing_request.request_id == "b-1"
        assert not held.done()  # model-a's request still waits for model-a's replicas
        fleet.free_model_a()
        async with asyncio.timeout(PATIENCE_S):
            assert (await held).routing_request.request_id == "a-1"


async def test_a_queued_request_that_cannot_be_routed_again_gets_a_503_and_the_rest_go_on() -> None:
    async def broken(routed: _Routed, only: object = None) -> _Routed:
        if routed.routing_request.request_id == "a-1":
            raise ValueError("no profile named 'gone'")  # e.g. a reload removed its profile
        return routed

    async with _Gate(_policy()) as fleet:
        first = fleet.admit(_routed("a-1", "model-a", ["a1", "a2"]), broken)
        second = fleet.admit(_routed("a-2", "model-a", ["a1", "a2"]), broken)
        await fleet.queued(2)
        fleet.free_model_a()
        async with asyncio.timeout(PATIENCE_S):
            assert (await second).routing_request.request_id == "a-2"
            with pytest.raises(GatewayError) as info:
                await first
    assert info.value.status == 503
    assert "routed again" in info.value.message
    # It left the queue without a verdict: counted, so that queued = admitted + shed + ... .
    failed = fleet.metrics.registry.get_sample_value(
        "fleetgate_flow_decisions_total",
        {"tenant": "t", "request_class": "standard", "decision": "failed",
         "reason": info.value.code},
    )
    assert failed == 1.0


async def test_a_client_that_leaves_as_its_request_is_released_is_counted_as_abandoned() -> None:
    async with _Gate(_policy()) as fleet:
        leaving = fleet.admit(_routed("a-1", "model-a", ["a1", "a2"]))
        await fleet.queued(1)
        fleet.free_model_a()
        async with asyncio.timeout(PATIENCE_S):  # released: its answer is set ...
            while fleet.gate.controller.head() is not None:
                await asyncio.sleep(0)
        leaving.cancel()  # ... and its client is gone before its handler runs again
        with pytest.raises(asyncio.CancelledError):
            await leaving
    counts = {
        decision: fleet.metrics.registry.get_sample_value(
            "fleetgate_flow_decisions_total",
            {"tenant": "t", "request_class": "standard", "decision": decision, "reason": reason},
        )
        for decision, reason in (("abandoned", "client_gone"), ("admit", "capacity_freed"))
    }
    assert counts == {"abandoned": 1.0, "admit": None}


async def test_a_reload_that_turns_flow_control_off_lets_queued_requests_go() -> None:
    async with _Gate(_policy()) as fleet:
        waiting = [fleet.admit(_routed(f"a-{i}", "model-a", ["a1", "a2"])) for i in range(3)]
        await fleet.queued(3)
        fleet.policy = _policy(enabled=False)  # the fleet is as saturated as before
        async with asyncio.timeout(PATIENCE_S):
            released = await asyncio.gather(*waiting)
    assert [r.routing_request.request_id for r in released] == ["a-0", "a-1", "a-2"]
    assert len(fleet.gate.controller.queue) == 0


async def test_a_prompt_over_the_tenants_whole_prompt_budget_is_a_400_not_a_retry() -> None:
    async with _Gate(_policy()) as fleet:
        with pytest.raises(GatewayError) as info:
            await fleet.admit(_routed("b-1", "model-b", ["b1", "b2"], prompt_tokens=101))
    assert info.value.status == 400
    assert "prompt_tokens_per_minute" in info.value.message
    assert "Retry-After" not in (info.value.headers or {})


async def test_budgets_hold_for_pinned_follow_ups_and_requests_not_tokenized_here() -> None:
    async with _Gate(_policy()) as fleet:
        gate, policy = fleet.gate, fleet.policy
        # A stored conversation's follow-up: nothing of the conversation counted when routed,
        # so its prompt tokens are settled from the engine's usage when it ends.
        untokenized = _routed("e-1", "model-b", ["b1"], prompt_tokens=0)
        admitted = await gate.admit_pinned(untokenized, {}, policy)
        assert admitted.budget_reserved is not None and admitted.budget_reserved.tokens == 0
        charge = gate.request_finished(
            policy,
            "t",
            {"prompt_tokens": 100, "completion_tokens": 1},
            "e-1",
            None,
            admitted.budget_reserved,
        )
        assert charge is not None
        await charge
        # The minute's prompt budget (100) is spent: the next one, pinned or not, waits for the
        # next minute.
        for admit in (
            gate.admit_pinned(_routed("f-1", "model-b", ["b1"], prompt_tokens=5), {}, policy),
            fleet.admit(_routed("f-2", "model-b", ["b1", "b2"], prompt_tokens=5)),
        ):
            with pytest.raises(GatewayError) as info:
                await admit
            assert info.value.status == 429 and "prompt tokens" in info.value.message


def test_a_stream_the_client_left_before_its_usage_is_charged_the_tokens_relayed() -> None:
    from gateway.proxy import UpstreamOutcome
    from gateway.request.handler import usage_to_charge

    answered = UpstreamOutcome(usage={"completion_tokens": 40}, ttft_s=0.1, output_events=41)
    assert usage_to_charge(answered) == {"completion_tokens": 40}
    left = UpstreamOutcome(ttft_s=0.1, output_events=30, client_gone=True)
    assert usage_to_charge(left) == {"completion_tokens": 30}
    broken = UpstreamOutcome(ttft_s=0.1, output_events=12, status=502)  # the replica failed
    assert usage_to_charge(broken) == {"completion_tokens": 12}
    before_any_token = UpstreamOutcome(client_gone=True)
    assert usage_to_charge(before_any_token) is None


async def test_without_its_pump_the_gate_admits_rather_than_queue_forever() -> None:
    """Expiry and admission from the queue are the pump's: with it gone (never started, or
    stopped), a request that would wait is sent on, with an error in the log."""
    policy = _policy()
    gate = FlowGate(replica_states=lambda: _states(model_a_waiting=5), policy=lambda: policy)
    async with asyncio.timeout(PATIENCE_S):
        admitted = await gate.admit(_routed("a-1", "model-a", ["a1", "a2"]), {}, policy, _unchanged)
    assert admitted.routing_request.request_id == "a-1"
    assert len(gate.controller.queue) == 0


async def test_the_prompt_reserved_is_settled_against_the_engines_count() -> None:
    """The reservation is the gateway's count (its tokenizer's, or ~4 characters a token, or an
    estimate of a batch's or an embeddings input's); the engine's usage settles it: a tenant
    whose text the estimate undercounts pays what it used, one it overcounts gets it back."""
    async with _Gate(_policy()) as fleet:
        gate, policy = fleet.gate, fleet.policy

        async def spend(request_id: str, reserve: int, engine: int) -> None:
            routed = _routed(request_id, "model-b", ["b1"], prompt_tokens=reserve)
            admitted = await gate.admit_pinned(routed, {}, policy)
            assert admitted.budget_reserved is not None
            assert admitted.budget_reserved.tokens == reserve
            charge = gate.request_finished(
                policy, "t", {"prompt_tokens": engine}, request_id, None, admitted.budget_reserved
            )
            assert charge is not None
            await charge

        await spend("over", reserve=40, engine=30)  # 10 given back: 30 of 100 used
        await spend("under", reserve=20, engine=70)  # 50 more charged: 100 of 100 used
        with pytest.raises(GatewayError) as info:
            await gate.admit_pinned(_routed("next", "model-b", ["b1"], prompt_tokens=1), {}, policy)
        assert info.value.status == 429 and "prompt tokens" in info.value.message


async def test_a_batch_or_an_input_over_the_whole_prompt_budget_is_refused_up_front() -> None:
    """A completions batch is routed on its first prompt, an embeddings request on nothing:
    their budget reserves every prompt of the batch, or the whole input (the review that found
    it: a 51-prompt batch of ~150k tokens reserved 2, one embeddings call used 300,200 tokens of
    a 2,000-token minute)."""
    async with _Gate(_policy()) as fleet:
        batch = _routed("batch", "model-b", ["b1"], prompt_tokens=5, budget_prompt_tokens=500)
        with pytest.raises(GatewayError) as info:
            await fleet.admit(batch)
        assert info.value.status == 400 and "prompt_tokens_per_minute" in info.value.message
