"""The engine's index lookup: every kind of lookup behaves as a timed ``await`` would.

An in-process index (``match_now``) is called directly, with no timer; any other lookup is
awaited under the index timeout. These cases pin the awaited path down: instant, suspending,
failing before or after suspending, too slow, a plain awaitable, cancelled from outside.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import pytest

from routing.contracts import IndexUnavailable, RoutingRequest
from routing.engine import RoutingEngine
from routing.policies.registry import builtin_profile
from routing.state import ReplicaState
from routing.types import BlockHash, ReplicaId

MODEL = "base-model"
CACHED = {ReplicaId("busy"): 400}


def replicas() -> list[ReplicaState]:
    # "busy" holds the whole prompt behind a queue: it wins only when the lookup's matches count.
    return [
        ReplicaState(
            replica_id=ReplicaId("busy"),
            url="http://busy",
            models=frozenset({MODEL}),
            inflight_prefill_tokens=2_000,
            inflight_requests=1,
        ),
        ReplicaState(replica_id=ReplicaId("idle"), url="http://idle", models=frozenset({MODEL})),
    ]


def request() -> RoutingRequest:
    return RoutingRequest(
        request_id="r1",
        model=MODEL,
        adapter=None,
        tenant="t",
        route="default",
        prompt_tokens=6_400,
        chain=[BlockHash(i) for i in range(400)],
        seed=7,
    )


class Index:
    """A lookup that suspends ``suspensions`` times, then fails or answers ``CACHED``."""

    def __init__(
        self, suspensions: int = 0, error: BaseException | None = None, sleep_s: float = 0.0
    ) -> None:
        self.suspensions = suspensions
        self.error = error
        self.sleep_s = sleep_s
        self.cancelled = False

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        try:
            for _ in range(self.suspensions):
                await asyncio.sleep(self.sleep_s)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.error is not None:
            raise self.error
        return dict(CACHED)


async def route(index: Any) -> tuple[Any, RoutingRequest]:
    engine = RoutingEngine(
        index, {"expected-ttft": builtin_profile("expected-ttft")}, index_timeout_s=0.05
    )
    req = request()
    return await engine.route(req, replicas(), "expected-ttft"), req


@pytest.mark.parametrize("suspensions", [0, 1, 3])
async def test_a_lookup_that_answers_in_time_is_used(suspensions: int) -> None:
    decision, req = await route(Index(suspensions))
    assert not decision.degraded
    assert req.prefix_matches == CACHED
    assert decision.replica == "busy"
    assert "index" in decision.timings_ms


@pytest.mark.parametrize("suspensions", [0, 2])
@pytest.mark.parametrize("error", [IndexUnavailable("down"), KeyError("bug")])
async def test_a_lookup_that_fails_degrades(suspensions: int, error: BaseException) -> None:
    decision, req = await route(Index(suspensions, error))
    assert decision.degraded
    assert req.prefix_matches is None
    assert decision.replica == "idle"


async def test_a_lookup_past_the_timeout_is_cancelled_and_degrades() -> None:
    index = Index(suspensions=1, sleep_s=10.0)
    decision, req = await asyncio.wait_for(route(index), timeout=5.0)
    assert decision.degraded
    assert req.prefix_matches is None
    assert index.cancelled  # the cancellation reached the lookup itself


async def test_a_lookup_returning_a_plain_awaitable_is_awaited_under_the_timeout() -> None:
    class FutureIndex:
        def match(self, chain: Sequence[BlockHash]) -> Awaitable[dict[ReplicaId, int]]:
            future: asyncio.Future[dict[ReplicaId, int]] = (
                asyncio.get_running_loop().create_future()
            )
            future.get_loop().call_soon(future.set_result, dict(CACHED))
            return future

    decision, req = await route(FutureIndex())
    assert not decision.degraded
    assert req.prefix_matches == CACHED


async def test_an_outer_cancellation_still_propagates() -> None:
    index = Index(suspensions=1, sleep_s=10.0)
    task = asyncio.create_task(
        RoutingEngine(
            index, {"expected-ttft": builtin_profile("expected-ttft")}, index_timeout_s=60.0
        ).route(request(), replicas(), "expected-ttft")
    )
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert index.cancelled
