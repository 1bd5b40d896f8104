"""The request path's seams: each phase's dependencies, a request kind, the decision log's JSON.

A policy-less gateway in text mode in front of a fake replica (real aiohttp servers on port 0).
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.request.account import AccountDeps
from gateway.request.forward import AttemptDeps, ForwardDeps
from gateway.request.handler import handle
from gateway.request.kinds import COMPLETION, RequestKind
from gateway.request.route import RouteDeps
from gateway.state import GATEWAY
from tests.integration.test_gateway_hotpath import LONG, CountingIndex, EngineUpstream
from tests.integration.test_gateway_support import serve

ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

#: The decision log's keys, in order, as ``/admin/decisions`` has always shown them.
ROUTING_KEYS = [
    "at",
    "request_id",
    "route",
    "tenant",
    "model",
    "adapter",
    "prompt_tokens",
    "blocks",
    "replica",
    "fallbacks",
    "profile",
    "degraded",
    "last_resort",
    "timings_ms",
    "explanations",
]
OUTCOME_KEYS = ["status", "served_by", "cached_tokens", "ttft_ms"]
PREDICTION_KEYS = ["predicted_cached_tokens", "prediction"]

#: A completion routed on load alone: what an endpoint without a prompt to match declares.
UNMATCHED_COMPLETION = RequestKind(
    "unmatched-completion",
    COMPLETION.upstream_path,
    COMPLETION.validate,
    COMPLETION.prompt,
    prefix_routed=False,
)


async def _unmatched(request: web.Request) -> web.StreamResponse:
    return await handle(request, UNMATCHED_COMPLETION)


def _app(upstream_url: str, index: CountingIndex) -> web.Application:
    spec = ReplicaSpec("r0", upstream_url, models=frozenset(["base-model"]))
    app = create_app(
        GatewayConfig(health_interval_s=3600, admin_key=ADMIN_KEY),
        GatewayPolicy.default([spec], profile="expected-ttft"),
        index=index,
    )
    app.router.add_post("/test/unmatched-completions", _unmatched)
    return app


async def _decisions(http: aiohttp.ClientSession, url: str, n: int) -> list[dict[str, Any]]:
    async with http.get(f"{url}/admin/decisions?n={n}", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        decisions: list[dict[str, Any]] = (await resp.json())["decisions"]
        return decisions


async def test_the_gateway_state_gives_every_phase_what_it_reads() -> None:
    gw = create_app(GatewayConfig(), GatewayPolicy.default([]))[GATEWAY]
    for deps in (RouteDeps, ForwardDeps, AttemptDeps, AccountDeps):
        assert isinstance(gw, deps), deps.__name__


async def test_the_decision_log_keeps_its_keys_and_their_order() -> None:
    upstream = EngineUpstream()
    upstream.prompt_tokens, upstream.cached_tokens = 1500, 0
    async with serve(upstream.app()) as upstream_url:
        app = _app(upstream_url, CountingIndex())
        async with serve(app) as url, aiohttp.ClientSession() as http:
            body = {"model": "base-model", "messages": [{"role": "user", "content": LONG}]}
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                request_id = resp.headers["X-Request-Id"]
            (decision,) = await _decisions(http, url, 1)
    # The engine reported cached tokens, so the prediction check ran and is logged.
    assert list(decision) == ROUTING_KEYS + PREDICTION_KEYS + OUTCOME_KEYS
    assert decision["request_id"] == request_id
    assert (decision["status"], decision["served_by"], decision["cached_tokens"]) == (200, "r0", 0)
    assert decision["prediction"] == "exact"  # a cold index predicted no cached tokens
    assert set(decision["explanations"]["r0"]) == {
        "matched_blocks",
        "scores",
        "terms",
        "filtered_out_by",
    }


async def test_a_kind_that_is_not_prefix_routed_routes_on_load_and_writes_no_blocks() -> None:
    upstream = EngineUpstream()
    index = CountingIndex()
    async with serve(upstream.app()) as upstream_url:
        app = _app(upstream_url, index)
        async with serve(app) as url, aiohttp.ClientSession() as http:
            body = {"model": "base-model", "prompt": LONG, "max_tokens": 3}
            async with http.post(f"{url}/test/unmatched-completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            (decision,) = await _decisions(http, url, 1)
    assert upstream.received[-1]["prompt"] == LONG  # the body went to the kind's upstream path
    assert (decision["blocks"], decision["prompt_tokens"]) == (0, 0)
    assert decision["status"] == 200
    assert index.writes == 0  # no blocks, no speculative write
