"""Replica health polling: a missed poll is not an outage; consecutive misses are."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.policy_view import ReplicaSpec
from gateway.replicas import ReplicaRegistry
from routing.types import ReplicaId


def _engine(metrics_text: Callable[[], str]) -> web.Application:
    """An engine that is healthy and answers /metrics with ``metrics_text()``."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics_text())

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def _itl_readings() -> Callable[[], str]:
    """The engine's ITL histogram read twice: 100 tokens, then 100 more at 60 ms each."""
    readings = iter([(2.0, 100), (8.0, 200)])

    def text() -> str:
        total_s, count = next(readings)
        return (
            f"vllm:num_requests_running 4\n"
            f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {total_s}\n'
            f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {count}\n'
        )

    return text


async def test_one_missed_health_poll_does_not_mark_a_replica_unhealthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = iter([200, 500, 200, 500, 500, 200])

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=next(answers))

    app = web.Application()
    app.router.add_get("/health", health)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        registry = ReplicaRegistry(unhealthy_after_polls=2)
        url = str(server.make_url("")).rstrip("/")
        registry.set_static([ReplicaSpec(replica_id="r0", url=url, models=frozenset({"m"}))])
        seen = []
        for _ in range(6):
            await registry.poll_once(session, timeout_s=2.0)
            state = registry.get(ReplicaId("r0"))
            assert state is not None
            seen.append(state.healthy)
    # 500 once: still healthy; 500 twice in a row: unhealthy; one good answer: healthy again.
    assert seen == [True, True, True, True, False, True]
    # The warning says where the replica is and why it was marked down, not only that it was.
    (warning,) = [r.getMessage() for r in caplog.records if "marked unhealthy" in r.getMessage()]
    assert url in warning and "/health answered 500" in warning


async def test_a_slow_metrics_scrape_does_not_mark_a_replica_unhealthy() -> None:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def broken(_: web.Request) -> web.Response:
        raise web.HTTPInternalServerError()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", broken)
    app.router.add_get("/v1/models", broken)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        registry = ReplicaRegistry(unhealthy_after_polls=1)
        url = str(server.make_url("")).rstrip("/")
        registry.set_static([ReplicaSpec(replica_id="r0", url=url, models=frozenset({"m"}))])
        await registry.poll_once(session, timeout_s=2.0)
        state = registry.get(ReplicaId("r0"))
        assert state is not None and state.healthy


async def test_polls_turn_the_engines_itl_histogram_into_its_recent_time_between_tokens() -> None:
    app = _engine(_itl_readings())
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        registry = ReplicaRegistry()
        url = str(server.make_url("")).rstrip("/")
        registry.set_static([ReplicaSpec(replica_id="r0", url=url, models=frozenset({"m"}))])
        await registry.poll_once(session, timeout_s=2.0)
        first = registry.get(ReplicaId("r0"))
        assert first is not None and first.decode_itl_ms is None  # one reading: no interval
        await registry.poll_once(session, timeout_s=2.0)
        second = registry.get(ReplicaId("r0"))
        assert second is not None and second.running == 4
        assert second.decode_itl_ms is not None and abs(second.decode_itl_ms - 60.0) < 1e-6


async def test_a_replica_never_heard_from_is_a_503_naming_it_not_an_unknown_model() -> None:
    # `serve --replica URL` without --model: the models come from /v1/models. With the only
    # replica at a wrong URL, "model not found" would send the user hunting for a typo.
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.policy_view import GatewayPolicy
    from tests.integration.test_gateway_support import serve
    from tests.support.redis_server import free_port

    port = free_port()
    dead = f"http://proxy-user:Replica-Secret@127.0.0.1:{port}"  # basic auth to a proxy
    spec = ReplicaSpec("replica-0", dead, models=frozenset())
    config = GatewayConfig(health_interval_s=0.05, admin_key="admin-key")
    app = create_app(config, GatewayPolicy.default([spec]))
    async with serve(app) as url, aiohttp.ClientSession() as http:
        async with http.post(
            f"{url}/v1/chat/completions",
            json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
        ) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
        # The operator finds the URL, its password hidden; a client is shown neither (the
        # security review: any caller read the fleet's addresses and a proxy's password).
        async with http.get(
            f"{url}/admin/replicas", headers={"Authorization": "Bearer admin-key"}
        ) as resp:
            assert resp.status == 200
            shown = (await resp.json())["replicas"][0]["url"]
    assert error["code"] == "no_healthy_replica"
    assert "replica-0" in error["message"] and "have not listed their models" in error["message"]
    assert "127.0.0.1" not in error["message"] and "Secret" not in error["message"]
    assert shown == f"http://proxy-user:***@127.0.0.1:{port}"


async def test_polls_read_the_engines_kv_cache_capacity_for_a_static_replica() -> None:
    # fleet-cost's eviction charge and its slack stickiness need each cache's size: a replica
    # listed statically (no agent) had none, and both were off for it.
    app = _engine(
        lambda: 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="2",num_gpu_blocks="None"} 1.0\n'
    )
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        registry = ReplicaRegistry()
        url = str(server.make_url("")).rstrip("/")
        registry.set_static([ReplicaSpec(replica_id="r0", url=url, models=frozenset({"m"}))])
        before = registry.get(ReplicaId("r0"))
        assert before is not None and before.kv_capacity_blocks is None
        await registry.poll_once(session, timeout_s=2.0)
        state = registry.get(ReplicaId("r0"))
    assert state is not None
    # Two profiled engine cores of 1,000 16-token blocks; the unprofiled one says nothing.
    assert state.kv_capacity_blocks * state.block_size == 2 * 1000 * 16


async def test_an_agents_report_keeps_what_this_gateway_read_of_the_engine() -> None:
    """Agents send neither the engine's decode pace nor its context length; their report wiped
    both at every fleet read: flow control lost the pace until the next poll, and routing could
    send a long prompt to a short context (the heterogeneous-fleet review)."""
    from routing.state import ReplicaState

    app = _engine(_itl_readings())

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 1024}]})

    app.router.add_get("/v1/models", models)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        registry = ReplicaRegistry()
        url = str(server.make_url("")).rstrip("/")
        reported = ReplicaState(replica_id=ReplicaId("r0"), url=url, models=frozenset({"m"}))
        registry.sync_discovered([reported])
        await registry.poll_once(session, timeout_s=2.0)
        await registry.poll_once(session, timeout_s=2.0)
        polled = registry.get(ReplicaId("r0"))
        assert polled is not None and polled.decode_itl_ms is not None
        assert polled.max_model_len == 1024
        registry.sync_discovered([reported])  # the agent's next report
        merged = registry.get(ReplicaId("r0"))
    assert merged is not None and merged.decode_itl_ms == polled.decode_itl_ms
    assert merged.max_model_len == 1024
    assert registry.max_model_len("m") == 1024


async def test_a_replica_is_healthy_only_while_both_its_agent_and_this_gateways_polls_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The live review's finding 1: a hung engine (it accepts, never answers) that its agent
    # still called up flapped every sync, the agent's registration undoing this gateway's
    # missed polls; the gateway drew requests into it in each healthy spell.
    from dataclasses import replace

    from routing.state import ReplicaState

    answering = asyncio.Event()  # cleared: /health hangs

    async def health(_: web.Request) -> web.Response:
        await answering.wait()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", health)
    r0 = ReplicaId("r0")
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        registry = ReplicaRegistry(unhealthy_after_polls=2)
        url = str(server.make_url("")).rstrip("/")
        up = ReplicaState(replica_id=r0, url=url, models=frozenset({"m"}), healthy=True)

        def healthy() -> bool:
            state = registry.get(r0)
            assert state is not None
            return state.healthy

        registry.sync_discovered([up])
        for _ in range(2):
            await registry.poll_once(session, timeout_s=0.2)
        assert not healthy()  # two missed polls
        registry.sync_discovered([up])  # its agent still says up
        assert not healthy()
        await registry.poll_once(session, timeout_s=0.2)
        assert not healthy()

        answering.set()
        await registry.poll_once(session, timeout_s=2.0)
        assert healthy()  # one answered poll brings it back, as for a static replica

        # The other way round: its agent says the engine is down, this gateway reaches it.
        registry.sync_discovered([replace(up, healthy=False)])
        assert not healthy()
        # Marked down as by missed polls: logged, and what it holds goes to a fallback.
        assert any(
            "marked unhealthy (its agent reports the engine down)" in r.getMessage()
            for r in caplog.records
        )
        await registry.poll_once(session, timeout_s=2.0)
        assert not healthy()
        registry.sync_discovered([up])
        assert healthy()


async def test_a_replica_its_agent_reports_down_is_no_last_resort() -> None:
    """Last resort is for replicas too busy to answer polls; one whose agent, beside it, says
    its engine is down (dead, hung, draining) is not one. A stopped engine still accepts
    connections (the kernel's backlog): sent there, requests waited for the upstream timeout
    (live review of ``fleetgate replica run``)."""
    from dataclasses import replace

    from routing.state import ReplicaState

    never = asyncio.Event()

    async def hung(_: web.Request) -> web.Response:
        await never.wait()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", hung)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        registry = ReplicaRegistry(unhealthy_after_polls=2)
        url = str(server.make_url("")).rstrip("/")
        busy, dead = ReplicaId("busy"), ReplicaId("dead")
        up = ReplicaState(replica_id=busy, url=url, models=frozenset({"m"}), healthy=True)
        registry.sync_discovered([up, replace(up, replica_id=dead, healthy=False)])
        for _ in range(2):
            await registry.poll_once(session, timeout_s=0.2)
        assert [s.replica_id for s in registry.last_resort("m")] == [busy]
        # Its agent says the engine is back: a last resort again while the polls still miss.
        registry.sync_discovered([up, replace(up, replica_id=dead, healthy=True)])
        assert sorted(s.replica_id for s in registry.last_resort("m")) == [busy, dead]


def test_a_drain_whose_agent_died_is_not_shown_for_an_hour() -> None:
    """Its agent died mid-drain: the registration expires and the polls decide alone. The last
    registration's ``draining`` stayed, and the replica showed healthy and draining at once
    for as long as the gateway knew it (diff review)."""
    from dataclasses import replace

    from routing.state import ReplicaState

    registry = ReplicaRegistry()
    rid = ReplicaId("r0")
    up = ReplicaState(replica_id=rid, url="http://127.0.0.1:9", models=frozenset({"m"}))
    registry.sync_discovered([up])
    registry.sync_discovered([replace(up, healthy=False, draining=True)])
    state = registry.get(rid)
    assert state is not None and state.draining and not state.healthy
    registry.sync_discovered([])  # expired, not removed: within the grace period, still known
    state = registry.get(rid)
    assert state is not None and not state.draining


async def test_a_departed_replica_still_finishing_shows_as_draining_past_the_grace_period() -> None:
    """A drain outlasts the 15 s grace period (the preStop hook waits up to 35 s): the replica
    vanished from /admin/replicas and its metrics while it still held requests, and showed as
    not draining meanwhile, like a dead one (re-check of the drain)."""
    from types import SimpleNamespace

    from routing.state import ReplicaState

    now = [0.0]
    registry = ReplicaRegistry(clock=lambda: now[0])
    rid = ReplicaId("r0")
    up = ReplicaState(replica_id=rid, url="http://127.0.0.1:9", models=frozenset({"m"}))
    registry.sync_discovered([up])
    attempt = registry.attempts.begin("req-1", rid, SimpleNamespace(responded=True))
    registry.sync_discovered([], departed=[rid])
    state = registry.get(rid)
    assert state is not None and not state.healthy and state.draining
    now[0] = registry.discovery_grace_s + 20
    registry.sync_discovered([], departed=[rid])
    state = registry.get(rid)
    assert state is not None and state.draining  # still known while it holds the request
    registry.attempts.end(attempt)
    registry.sync_discovered([], departed=[rid])
    assert registry.get(rid) is None  # done: forgotten
