"""Engine figures no engine can report, on real sockets: the gateway keeps serving.

From the routing review of session 46: one request count past 2**63 on one replica's
``/metrics`` failed every request once the fleet was rebuilt (a replica joining, a reload), and
``/ready`` with it; a KV usage that stayed NaN on one rank froze the reading of fresh counts,
and a minute later the replica took no request; a failure taking in agent-registered replicas
ended the health loop for good.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from contextlib import AsyncExitStack

import aiohttp
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.replicas import parse_vllm_metrics
from gateway.state import GATEWAY
from replica.fleet_store import MemoryFleetStore
from routing.state import ReplicaState
from routing.types import ReplicaId
from tests.integration.test_gateway_support import FakeUpstream, serve
from tests.support.polling import wait_until

CHAT = {"model": "base-model", "messages": [{"role": "user", "content": "hello there"}]}


def test_counts_sum_over_ranks_and_the_kv_usage_is_the_fullest_ranks() -> None:
    text = (
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 3\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.6\nvllm:kv_cache_usage_perc{engine="1"} 0.5\n'
    )
    assert parse_vllm_metrics(text) == {"waiting": 5.0, "kv_usage": 0.6}  # not 1.1: full
    # A rank that glitches does not hide a full one (its last reading could be an empty cache).
    glitched = text.replace('{engine="1"} 0.5', '{engine="1"} NaN').replace("0.6", "0.97")
    assert parse_vllm_metrics(glitched)["kv_usage"] == 0.97
    absurd = parse_vllm_metrics("vllm:num_requests_waiting 1.8446744073709552e+19\n")
    assert math.isnan(absurd["waiting"])  # a glitch: the last value stands


async def _fleet(stack: AsyncExitStack, count: int) -> tuple[list[FakeUpstream], list[str]]:
    upstreams = [FakeUpstream() for _ in range(count)]
    urls = [await stack.enter_async_context(serve(u.app())) for u in upstreams]
    return upstreams, urls


async def _polled(upstream: FakeUpstream) -> None:
    """Until the gateway has polled ``upstream`` through at least once more."""
    seen = upstream.health_polls
    await wait_until(lambda: upstream.health_polls >= seen + 2, "two more health polls")


async def test_an_absurd_request_count_never_fails_requests_as_replicas_join() -> None:
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        (_a, b, _c), urls = await _fleet(stack, 3)
        models = frozenset({"base-model"})
        specs = [ReplicaSpec(n, u, models=models) for n, u in zip("abc", urls, strict=True)]
        app = create_app(GatewayConfig(health_interval_s=0.05), GatewayPolicy.default(specs[:2]))
        url = await stack.enter_async_context(serve(app, handler_cancellation=True))
        b.waiting = 2**64 - 1  # an unsigned -1
        await _polled(b)
        registry = app[GATEWAY].registry
        registry.upsert(ReplicaState(ReplicaId("c"), urls[2], models=frozenset({"base-model"})))
        statuses = Counter()
        for _ in range(10):
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                statuses[resp.status] += 1
        assert statuses == {200: 10}
        for path in ("/ready", "/metrics"):
            async with http.get(url + path) as resp:
                assert resp.status == 200, path
        assert registry.get(ReplicaId("b")).waiting == 0  # the glitch kept the last figure


async def test_a_kv_usage_that_stays_nan_does_not_leave_the_replicas_counts_stale() -> None:
    async with AsyncExitStack() as stack:
        (a,), urls = await _fleet(stack, 1)
        app = create_app(
            GatewayConfig(health_interval_s=0.05),
            GatewayPolicy.default([ReplicaSpec("a", urls[0], models=frozenset({"base-model"}))]),
        )
        await stack.enter_async_context(serve(app, handler_cancellation=True))
        a.kv_usage = 0.5
        await _polled(a)
        a.kv_usage, a.waiting = math.nan, 4
        asked = time.time()
        await _polled(a)
        state = app[GATEWAY].registry.get(ReplicaId("a"))
        assert state.waiting == 4 and state.kv_usage == 0.5  # counts fresh, usage kept
        assert state.metrics_read_at >= asked


async def test_a_failure_taking_in_registered_replicas_does_not_end_the_health_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with AsyncExitStack() as stack:
        (a,), urls = await _fleet(stack, 1)
        app = create_app(
            GatewayConfig(health_interval_s=0.05),
            GatewayPolicy.default([ReplicaSpec("a", urls[0], models=frozenset({"base-model"}))]),
            fleet_store=MemoryFleetStore(),  # replicas agents register: taken in every poll
        )
        await stack.enter_async_context(serve(app, handler_cancellation=True))
        registry = app[GATEWAY].registry

        def fails(*_args: object) -> None:
            raise OverflowError("int too large to convert to C long")

        monkeypatch.setattr(registry, "sync_discovered", fails)
        await _polled(a)
        await _polled(a)  # still polling after the failures
        a.health_ok = False
        await wait_until(
            lambda: not registry.get(ReplicaId("a")).healthy, "the replica marked down"
        )
