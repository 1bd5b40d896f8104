"""The gateway's adapter wiring without sockets: adapter-list freshness in the replica registry,
the engine's slot count from ``/metrics``, and how registry errors become fallbacks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from adapters_registry import AdapterLoadFailed, NoAdapterSlot, ThrashGuardTripped
from adapters_registry.loader import LoadResult
from gateway.adapters import hold_adapter
from gateway.errors import GatewayError
from gateway.proxy import ReplicaUnsuitable
from gateway.replicas import LoraInfo, ReplicaRegistry, parse_lora_info
from routing.contracts import RoutingRequest
from routing.policies.expected_ttft import ExpectedTtftScorer
from routing.state import ReplicaState
from routing.types import ReplicaId

R0 = ReplicaId("pool-a/0")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
            'waiting_lora_adapters="c"} 1.7e9\n',
            LoraInfo(4, frozenset({"a", "b"}), frozenset({"c"})),
        ),
        (
            'vllm:lora_requests_info{running_lora_adapters="",max_lora="1",'
            'waiting_lora_adapters=""} 1.0\n',
            LoraInfo(1),
        ),
        ("vllm:num_requests_running 3\n", None),
        ('vllm:lora_requests_info{max_lora="many"} 1\n', LoraInfo(None)),
        # One sample per label set ever seen: the current one has the latest value (set time).
        (
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",'
            'waiting_lora_adapters=""} 20.0\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",'
            'waiting_lora_adapters="x"} 10.0\n',
            LoraInfo(2, frozenset({"new"})),
        ),
    ],
)
def test_lora_slots_and_adapters_from_engine_metrics(
    text: str, expected: LoraInfo | None
) -> None:
    assert parse_lora_info(text) == expected


class _Response:
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self._body = body

    async def json(self) -> Any:
        return self._body

    async def text(self) -> str:
        return str(self._body)


class _Session:
    """Answers the health poll's three GETs from a table: path -> (status, body)."""

    def __init__(self, answers: dict[str, tuple[int, Any]]) -> None:
        self.answers = answers

    @contextlib.asynccontextmanager
    async def get(self, url: str, timeout: Any = None) -> AsyncIterator[_Response]:
        path = "/" + url.split("/", 3)[3]
        yield _Response(*self.answers[path])


def _models(*adapters: str) -> dict[str, Any]:
    data = [{"id": "base", "parent": None}] + [{"id": a, "parent": "base"} for a in adapters]
    return {"data": data}


METRICS = 'vllm:num_requests_running 0\nvllm:lora_requests_info{max_lora="2"} 1\n'


async def test_adapter_list_freshness_is_its_own_not_the_gauges() -> None:
    registry = ReplicaRegistry()
    registry.upsert(ReplicaState(replica_id=R0, url="http://r0"))
    assert registry.adapters_read_at(R0) == 0.0  # never read: no fresh claim of "none loaded"

    ok = {"/health": (200, ""), "/v1/models": (200, _models("a")), "/metrics": (200, METRICS)}
    await registry.poll_once(_Session(ok))  # type: ignore[arg-type]
    first = registry.adapters_read_at(R0)
    state = registry.get(R0)
    assert state is not None and first > 0
    assert state.loaded_adapters == {"a"} and state.max_loras == 2
    assert registry.adapter_view(state).metrics_read_at == first

    # /v1/models fails, /metrics answers: the adapter list (and its time) stays as it was read.
    models_down = {**ok, "/v1/models": (500, {})}
    await registry.poll_once(_Session(models_down))  # type: ignore[arg-type]
    state = registry.get(R0)
    assert state is not None and state.loaded_adapters == {"a"}
    assert registry.adapters_read_at(R0) == first
    assert state.metrics_read_at >= first

    # /metrics fails, /v1/models answers: the adapter list is fresh even though gauges are not.
    metrics_down = {**ok, "/v1/models": (200, _models()), "/metrics": (500, "")}
    await registry.poll_once(_Session(metrics_down))  # type: ignore[arg-type]
    state = registry.get(R0)
    assert state is not None and state.loaded_adapters == frozenset()
    assert registry.adapters_read_at(R0) >= first
    assert registry.adapter_view(state).metrics_read_at == registry.adapters_read_at(R0)


def test_agent_reports_carry_their_own_read_time() -> None:
    registry = ReplicaRegistry(discovery_grace_s=0)
    reported = ReplicaState(
        replica_id=R0, url="http://r0", loaded_adapters=frozenset({"a"}), metrics_read_at=123.0
    )
    registry.sync_discovered([reported])
    assert registry.adapters_read_at(R0) == 123.0
    registry.sync_discovered([])  # registration expired
    assert registry.get(R0) is None and registry.adapters_read_at(R0) == 0.0


def test_a_replica_missing_from_one_listing_is_kept_for_the_grace_period() -> None:
    # A restarted, empty Redis lists nobody until the agents register again: the replicas must
    # stay routable meanwhile (dropping them answered 503 with the whole fleet up).
    now = [100.0]
    registry = ReplicaRegistry(discovery_grace_s=15.0, clock=lambda: now[0])
    r1 = ReplicaId("r1")
    registry.sync_discovered([ReplicaState(replica_id=R0, url="http://r0"),
                              ReplicaState(replica_id=r1, url="http://r1")])
    registry.sync_discovered([])  # Redis restarted: an empty listing
    now[0] += 14.9
    registry.sync_discovered([ReplicaState(replica_id=R0, url="http://r0")])  # r0 is back
    assert {s.replica_id for s in registry.routable()} == {R0, r1}
    now[0] += 0.1  # r1 missing for the whole grace period: forgotten
    registry.sync_discovered([ReplicaState(replica_id=R0, url="http://r0")])
    assert [s.replica_id for s in registry.routable()] == [R0]
    registry.sync_discovered([])  # r0's grace starts afresh: it was seen since
    assert registry.get(R0) is not None


async def test_an_expired_registration_of_a_replica_that_still_answers_keeps_it_routed() -> None:
    # Agents that cannot write to Redis (full, noeviction) let every registration expire: the
    # gateway dropped every healthy replica and answered 503 to all traffic. A replica its own
    # health polls still reach is kept; one removed on purpose, or that stops answering, is not.
    now = [100.0]
    registry = ReplicaRegistry(discovery_grace_s=15.0, clock=lambda: now[0])
    r1 = ReplicaId("r1")
    registry.sync_discovered([ReplicaState(replica_id=R0, url="http://r0"),
                              ReplicaState(replica_id=r1, url="http://r1")])
    ok = {"/health": (200, ""), "/v1/models": (200, _models()), "/metrics": (200, METRICS)}
    registry.sync_discovered([])  # both registrations expired
    now[0] += 16.0
    await registry.poll_once(_Session(ok))  # type: ignore[arg-type]
    registry.sync_discovered([])
    assert {s.replica_id for s in registry.routable()} == {R0, r1}
    # One slow health poll is not an outage (it takes two in a row): the replicas stay.
    slow = {"/health": (503, ""), "/v1/models": (503, ""), "/metrics": (503, "")}
    await registry.poll_once(_Session(slow))  # type: ignore[arg-type]
    registry.sync_discovered([])
    await registry.poll_once(_Session(ok))  # type: ignore[arg-type]
    registry.sync_discovered([])
    assert {s.replica_id for s in registry.routable()} == {R0, r1}
    registry.sync_discovered([], departed={r1})  # r1's agent removed it on purpose
    assert [s.replica_id for s in registry.routable()] == [R0]
    down = {"/health": (503, ""), "/v1/models": (503, ""), "/metrics": (503, "")}
    await registry.poll_once(_Session(down))  # type: ignore[arg-type]
    await registry.poll_once(_Session(down))  # type: ignore[arg-type]
    registry.sync_discovered([])  # r0 stops answering too: gone
    assert registry.get(R0) is None


async def test_a_replica_kept_without_registration_is_kept_an_hour_at_most() -> None:
    # A removal its agent could not write (Redis refusing writes) must not keep it for ever.
    now = [100.0]
    registry = ReplicaRegistry(discovery_grace_s=15.0, clock=lambda: now[0])
    registry.sync_discovered([ReplicaState(replica_id=R0, url="http://r0")])
    ok = {"/health": (200, ""), "/v1/models": (200, _models()), "/metrics": (200, METRICS)}
    registry.sync_discovered([])
    now[0] += 3599.0
    await registry.poll_once(_Session(ok))  # type: ignore[arg-type]
    registry.sync_discovered([])
    assert registry.get(R0) is not None
    now[0] += 2.0
    await registry.poll_once(_Session(ok))  # type: ignore[arg-type]
    registry.sync_discovered([])
    assert registry.get(R0) is None


class _Registry:
    """``AdapterRegistry.serving`` that raises ``error`` on entry (or yields a result)."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.last_resort: bool | None = None

    @contextlib.asynccontextmanager
    async def serving(
        self, replica: ReplicaState, adapter: str, *, last_resort: bool = False
    ) -> AsyncIterator[LoadResult]:
        self.last_resort = last_resort
        if self.error is not None:
            raise self.error
        yield LoadResult(cold_ms=12.0, loaded_now=True)


def _hold(registry: _Registry, replica: ReplicaState, last_resort: bool) -> Any:
    """``hold_adapter`` of adapter ``x`` on ``replica``, over the fake registry."""
    fake: Any = registry  # the registry's ``serving`` is all hold_adapter calls
    return hold_adapter(fake, ReplicaRegistry(), replica, "x", last_resort=last_resort)


@pytest.mark.parametrize(
    ("error", "reason", "status", "code"),
    [
        (NoAdapterSlot("x", "r0", 2, ["p", "q"]), "no_adapter_slot", 503, "no_adapter_slot"),
        (
            ThrashGuardTripped("x", "r0", 20, 20, 60.0),
            "adapter_thrash_guard",
            503,
            "no_adapter_slot",
        ),
        (
            AdapterLoadFailed("x", "r0", "disk full", 500),
            "adapter_load_failed",
            502,
            "adapter_load_failed",
        ),
    ],
)
async def test_registry_refusals_become_fallbacks(
    error: Exception, reason: str, status: int, code: str
) -> None:
    replica = ReplicaState(replica_id=R0, url="http://r0")
    with pytest.raises(ReplicaUnsuitable) as caught:
        async with _hold(_Registry(error), replica, last_resort=False):
            pytest.fail("the body must not run when the adapter could not be held")
    assert caught.value.reason == reason
    assert (caught.value.error.status, caught.value.error.code) == (status, code)
    assert "disk full" not in caught.value.error.message  # engine text stays in the log


async def test_hold_passes_last_resort_and_yields_the_load() -> None:
    registry = _Registry(None)
    replica = ReplicaState(replica_id=R0, url="http://r0")
    async with _hold(registry, replica, last_resort=True) as load:
        assert load.loaded_now and load.cold_ms == 12.0
    assert registry.last_resort is True


async def test_errors_inside_the_held_attempt_are_not_fallbacks() -> None:
    replica = ReplicaState(replica_id=R0, url="http://r0")
    with pytest.raises(GatewayError):
        async with _hold(_Registry(None), replica, last_resort=False):
            raise GatewayError(504, "upstream_timeout", "slow")


async def test_the_poll_reads_which_adapters_hold_the_lora_slots() -> None:
    """vLLM's ``lora_requests_info`` (as the e2e tier's engines print it): the adapters running
    hold the slots, and routing's slot wait reads them."""
    registry = ReplicaRegistry()
    registry.upsert(ReplicaState(replica_id=R0, url="http://r0"))
    metrics = (
        "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 1.7963563077854762e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7963563e+09\n'
    )
    answers = {"/health": (200, ""), "/v1/models": (200, _models("a", "b", "c")),
               "/metrics": (200, metrics)}
    await registry.poll_once(_Session(answers))  # type: ignore[arg-type]
    state = registry.get(R0)
    assert state is not None
    assert (state.max_loras, state.running_adapters, state.waiting_adapters) == (
        2, {"a", "b"}, {"c"}
    )
    assert state.waiting_only_for_slots
    scorer = ExpectedTtftScorer(clock=lambda: state.metrics_read_at)
    request = RoutingRequest(request_id="r", model="base", adapter="c", tenant="t", route="d",
                             prompt_tokens=100, chain=[], seed=1)
    assert scorer.estimate(request, state).adapter_slot_wait_ms > 0
    assert scorer.estimate(replace(request, adapter="a"), state).adapter_slot_wait_ms == 0
