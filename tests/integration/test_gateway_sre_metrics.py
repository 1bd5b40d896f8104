"""What an SRE deploys and watches: readiness, errors and goodput, per-pod load, replica gauges.

Each test is one finding of the observability review (docs/metrics.md, docs/operations.md):
``/ready`` is the gateway's own readiness, a relayed engine 5xx is an error and an SLO miss, the
gateway's own in-flight count is exported for the HPA, and a replica that leaves takes its gauges.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.state import GATEWAY, GatewayState
from tests.integration.test_gateway_support import FakeUpstream, serve

CHAT = {"model": "base-model", "messages": [{"role": "user", "content": "hello there"}]}


@asynccontextmanager
async def gateway(
    upstreams: list[FakeUpstream], **config: object
) -> AsyncIterator[tuple[str, GatewayState]]:
    """Fake upstreams behind a policy-less gateway; yields its URL and its state."""
    async with _serve_all(upstreams) as urls:
        specs = [
            ReplicaSpec(f"r{i}", url, models=frozenset(u.models))
            for i, (u, url) in enumerate(zip(upstreams, urls, strict=True))
        ]
        cfg = GatewayConfig(health_interval_s=3600, **config)  # type: ignore[arg-type]
        app = create_app(cfg, GatewayPolicy.default(specs))
        async with serve(app, handler_cancellation=True) as url:
            yield url, app[GATEWAY]


@asynccontextmanager
async def _serve_all(upstreams: list[FakeUpstream]) -> AsyncIterator[list[str]]:
    stack = []
    urls: list[str] = []
    try:
        for upstream in upstreams:
            cm = serve(upstream.app())
            upstream.url = await cm.__aenter__()
            stack.append(cm)
            urls.append(upstream.url)
        yield urls
    finally:
        for cm in reversed(stack):
            await cm.__aexit__(None, None, None)


def _value(gw: GatewayState, name: str, **labels: str) -> float | None:
    return gw.metrics.registry.get_sample_value(name, labels)


async def _scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


# ------------------------------------------------------------------------- /ready (finding 4)


async def test_ready_stays_200_while_one_models_replicas_are_down() -> None:
    """One model's pool down must not take the gateway (and the healthy model) out of the
    Service: ``/ready`` is 200, and its body still says which model has no healthy replica."""
    small = FakeUpstream(models=["base-model"])
    big = FakeUpstream(models=["big-model"], health_ok=False)
    async with gateway([small, big]) as (url, gw), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/ready") as resp:
            body = await resp.json()
            assert resp.status == 200, body
        assert body["ready"] is True and body["all_models_ready"] is False
        assert body["models"] == {"base-model": True, "big-model": False}
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        gw.stopping = True  # SIGTERM: leave the load balancer's rotation
        async with http.get(f"{url}/ready") as resp:
            assert resp.status == 503
            assert (await resp.json())["draining"] is True
        gw.stopping = False


# ------------------------------------------------------------- errors and goodput (finding 6)


async def test_a_relayed_engine_5xx_is_an_error_and_an_slo_miss() -> None:
    upstream = FakeUpstream(fail_status=500)  # an engine whose core died, no fallback left
    async with gateway([upstream]) as (url, gw), aiohttp.ClientSession() as http:
        async with http.post(
            f"{url}/v1/chat/completions", json={**CHAT, "stream": True}
        ) as resp:
            assert resp.status == 500
        await asyncio.sleep(0.05)  # accounting runs right after the answer
        assert _value(gw, "fleetgate_errors_total", route="default", code="upstream_error") == 1
        slo = "fleetgate_slo_requests_total"
        assert _value(gw, slo, route="default", slo="all", outcome="missed") == 1
        assert _value(gw, slo, route="default", slo="ttft", outcome="missed") == 1
        # A served non-streamed request has no TTFT to check, but it counts for goodput.
        upstream.fail_status = None
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        await asyncio.sleep(0.05)
        assert _value(gw, slo, route="default", slo="all", outcome="met") == 1
        assert _value(gw, slo, route="default", slo="ttft", outcome="met") is None


async def test_the_gateways_own_503_is_counted_once_and_is_an_slo_miss() -> None:
    upstream = FakeUpstream(drop_completions=True)  # every attempt fails before the first byte
    async with gateway([upstream]) as (url, gw), aiohttp.ClientSession() as http:
        await _scrape(http, url)  # label sets created at 0
        async with http.post(
            f"{url}/v1/chat/completions", json={**CHAT, "stream": True}
        ) as resp:
            assert resp.status == 503
        await asyncio.sleep(0.05)
        assert _value(gw, "fleetgate_errors_total", route="default", code="no_healthy_replica") == 1
        assert _value(gw, "fleetgate_errors_total", route="default", code="upstream_error") == 0
        slo = "fleetgate_slo_requests_total"
        assert _value(gw, slo, route="default", slo="all", outcome="missed") == 1
        assert _value(gw, slo, route="default", slo="all", outcome="met") == 0


async def test_a_client_that_leaves_after_its_first_token_is_not_goodput() -> None:
    """The metrics review: a stream the client closed after its first token (499) counted as
    goodput met, though the request did not succeed. Its TTFT still counts; goodput does not
    count it either way (the client left, the fleet did not fail)."""
    upstream = FakeUpstream(stream_gate=asyncio.Event())  # first chunk, then waits
    async with gateway([upstream]) as (url, gw), aiohttp.ClientSession() as http:
        await _scrape(http, url)
        async with http.post(
            f"{url}/v1/chat/completions", json={**CHAT, "stream": True}
        ) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first token's event
            resp.close()  # and the client goes
        async with asyncio.timeout(10):  # the gateway sees the client go, then accounts
            await upstream.client_gone.wait()
            while _value(
                gw, "fleetgate_requests_total",
                route="default", model="base-model", replica="r0", status="499",
            ) != 1:
                await asyncio.sleep(0.01)
        slo = "fleetgate_slo_requests_total"
        assert _value(gw, slo, route="default", slo="ttft", outcome="met") == 1
        assert _value(gw, slo, route="default", slo="all", outcome="met") == 0
        assert _value(gw, slo, route="default", slo="all", outcome="missed") == 0


async def test_no_flow_control_bound_is_exported_while_flow_control_is_off() -> None:
    """The metrics review: with no flow control the bound gauge read 0 from start (out of its
    0.5-1 range) and 0.8 after the first requests, and the dashboard drew both."""
    async with gateway([FakeUpstream()]) as (url, _gw), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        text = await _scrape(http, url)
    assert "# TYPE fleetgate_flow_itl_bound_ratio gauge" in text  # documented, described
    assert "\nfleetgate_flow_itl_bound_ratio " not in text  # but no value
    # Born at 0, so increase() sees the first reload (the same review).
    assert 'fleetgate_policy_reloads_total{outcome="ok"} 0.0' in text


async def test_client_errors_are_not_slo_misses() -> None:
    async with gateway([FakeUpstream()]) as (url, gw), aiohttp.ClientSession() as http:
        await _scrape(http, url)
        async with http.post(f"{url}/v1/chat/completions", json={"model": "base-model"}) as resp:
            assert resp.status == 400
        slo = "fleetgate_slo_requests_total"
        assert _value(gw, slo, route="default", slo="all", outcome="missed") == 0


# ------------------------------------------------------ the gateway's own load (finding 3)


async def test_gateway_inflight_requests_counts_this_gateways_requests() -> None:
    gate = asyncio.Event()
    upstream = FakeUpstream(stream_gate=gate)
    async with gateway([upstream]) as (url, gw), aiohttp.ClientSession() as http:
        assert _value(gw, "fleetgate_gateway_inflight_requests") == 0
        async with http.post(
            f"{url}/v1/chat/completions", json={**CHAT, "stream": True}
        ) as resp:
            try:
                await resp.content.readline()  # the first chunk: the request is in flight
                text = await _scrape(http, url)
            finally:
                gate.set()  # never leave the stream hanging, even on a failed assertion
            assert "fleetgate_gateway_inflight_requests 1.0" in text
            await resp.read()
        assert _value(gw, "fleetgate_gateway_inflight_requests") == 0


# ------------------------------------------------- a replica that leaves (finding 5)


async def test_a_replica_that_leaves_takes_its_gauges() -> None:
    upstreams = [FakeUpstream(), FakeUpstream()]
    async with gateway(upstreams) as (url, gw), aiohttp.ClientSession() as http:
        text = await _scrape(http, url)
        assert 'fleetgate_replica_healthy{replica="r1"} 1.0' in text
        assert 'fleetgate_replica_inflight{replica="r1"}' in text
        # A policy reload (or an agent deregistering) drops r1.
        kept = ReplicaSpec("r0", upstreams[0].url, models=frozenset(["base-model"]))
        gw.registry.set_static([kept])
        text = await _scrape(http, url)
        assert 'replica="r1"' not in text
        assert 'fleetgate_replica_healthy{replica="r0"} 1.0' in text
