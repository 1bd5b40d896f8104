"""Last-resort routing: when every replica of a model misses its health polls, serve anyway.

A replica busy enough to miss ``/health`` polls usually still serves; answering 503 then fails
requests the fleet could have served. The gateway routes among such replicas as a last resort,
with circuit breakers still applying; 503 only when none is reachable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from tests.integration.test_gateway_support import FakeUpstream, serve
from tests.support.polling import wait_until

CHAT = {"model": "base-model", "messages": [{"role": "user", "content": "hello there"}]}
ADMIN = {"Authorization": "Bearer adm"}


@asynccontextmanager
async def gateway(upstreams: list[FakeUpstream]) -> AsyncIterator[str]:
    """A policy-less gateway polling its fake upstreams often, so health changes show quickly."""
    async with _serve_upstreams(upstreams) as urls:
        specs = [
            ReplicaSpec(f"r{i}", url, models=frozenset(u.models))
            for i, (u, url) in enumerate(zip(upstreams, urls, strict=True))
        ]
        cfg = GatewayConfig(health_interval_s=0.05, admin_key="adm")
        app = create_app(cfg, GatewayPolicy.default(specs))
        async with serve(app, handler_cancellation=True) as url:
            yield url


@asynccontextmanager
async def _serve_upstreams(upstreams: list[FakeUpstream]) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        urls = []
        for upstream in upstreams:
            upstream.url = await stack.enter_async_context(serve(upstream.app()))
            urls.append(upstream.url)
        yield urls


async def _health_view(http: aiohttp.ClientSession, url: str) -> dict[str, bool]:
    async with http.get(f"{url}/admin/replicas", headers=ADMIN) as resp:
        return {r["replica_id"]: r["healthy"] for r in (await resp.json())["replicas"]}


async def _all_unhealthy(http: aiohttp.ClientSession, url: str) -> None:
    async def unhealthy() -> bool:
        view = await _health_view(http, url)
        return bool(view) and not any(view.values())

    await wait_until(unhealthy, "every replica is marked unhealthy by missed health polls")


async def _metric(http: aiohttp.ClientSession, url: str, prefix: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def test_every_replica_missing_health_polls_still_serves_as_last_resort() -> None:
    upstreams = [FakeUpstream(health_ok=False), FakeUpstream(health_ok=False)]
    async with gateway(upstreams) as url, aiohttp.ClientSession() as http:
        await _all_unhealthy(http, url)
        for _ in range(4):
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200, await resp.text()
        async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        last_resort = await _metric(http, url, "fleetgate_last_resort_decisions_total{")
        async with http.get(f"{url}/admin/decisions?n=1", headers=ADMIN) as resp:
            (decision,) = (await resp.json())["decisions"]
    assert sum(u.attempts for u in upstreams) == 5
    assert last_resort == 5
    assert decision["last_resort"] is True


async def test_a_healthy_replica_is_preferred_over_last_resort() -> None:
    sick, well = FakeUpstream(health_ok=False), FakeUpstream()

    async with gateway([sick, well]) as url, aiohttp.ClientSession() as http:

        async def only_r0_unhealthy() -> bool:
            return await _health_view(http, url) == {"r0": False, "r1": True}

        await wait_until(only_r0_unhealthy, "r0 is unhealthy and r1 healthy")
        for _ in range(4):
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
        last_resort = await _metric(http, url, "fleetgate_last_resort_decisions_total{")
    assert (sick.attempts, well.attempts) == (0, 4)
    assert last_resort == 0


async def test_last_resort_replicas_that_refuse_requests_end_in_503() -> None:
    upstreams = [FakeUpstream(health_ok=False, drop_completions=True) for _ in range(2)]
    async with gateway(upstreams) as url, aiohttp.ClientSession() as http:
        await _all_unhealthy(http, url)
        statuses = []
        # Each request tries both (a dropped request is retried elsewhere) and fails; after the
        # breakers' threshold of failures every circuit is open and no replica is even tried.
        for _ in range(4):
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                statuses.append((resp.status, (await resp.json())["error"]["code"]))
        attempts_when_open = sum(u.attempts for u in upstreams)
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"
            # Which model, not the routing internals (profile, filters): those are logged.
            message = (await resp.json())["error"]["message"]
    assert message == "No healthy replica serves model 'base-model' right now; retry shortly."
    assert statuses == [(503, "no_healthy_replica")] * 4
    assert sum(u.attempts for u in upstreams) == attempts_when_open  # circuits open: none tried
