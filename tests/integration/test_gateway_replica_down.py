"""A replica marked down while it holds unanswered requests: they go to a fallback at once.

A hung replica (it accepts, never answers) is found by the health loop after a few missed polls;
before this, the requests already sent to it waited for it as long as their clients did (the
chaos bench's finding 4). Now the gateway aborts every attempt the replica holds whose answer has
not started, and retries it on a fallback: nothing had reached the client.

A replica that refuses a connection (its engine was killed) is out of routing at once, until a
health poll it answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.state import GATEWAY
from tests.integration.test_gateway_support import FakeUpstream, serve
from tests.support.polling import wait_until
from tests.support.redis_server import free_port

CHAT = {"model": "base-model", "messages": [{"role": "user", "content": "hello there"}]}
ADMIN = {"Authorization": "Bearer adm"}


async def _metric(http: aiohttp.ClientSession, url: str, prefix: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def _gateway_over(
    stack: AsyncExitStack, first: tuple[str, str, FakeUpstream], well: FakeUpstream
) -> str:
    """A gateway (health polls every 50 ms, admin key ``adm``) over ``first`` (name, URL,
    upstream) and ``well``; returns its URL."""
    name, first_url, upstream = first
    well_url = await stack.enter_async_context(serve(well.app()))
    specs = [
        ReplicaSpec(name, first_url, models=frozenset(upstream.models)),
        ReplicaSpec("well", well_url, models=frozenset(well.models)),
    ]
    cfg = GatewayConfig(health_interval_s=0.05, admin_key="adm")
    return await stack.enter_async_context(
        serve(create_app(cfg, GatewayPolicy.default(specs)), handler_cancellation=True)
    )


async def _one_held_by(
    http: aiohttp.ClientSession, url: str, stream: bool, holder: FakeUpstream
) -> asyncio.Task[tuple[int, bytes]]:
    """Requests until one is held by ``holder`` (routing spreads near-ties; the others are
    answered by the well replica at once); returns the held request's task."""

    async def chat() -> tuple[int, bytes]:
        async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
            try:
                return resp.status, await resp.read()
            except aiohttp.ClientPayloadError as exc:  # the stream was cut
                return resp.status, repr(exc).encode()

    for _ in range(60):
        task = asyncio.create_task(chat())
        await wait_until(
            lambda: task.done() or holder.attempts > 0,  # noqa: B023 (awaited at once)
            "the request is answered or held by the replica under test",
        )
        if holder.attempts > 0:
            assert not task.done()
            return task
        assert task.result()[0] == 200
    raise AssertionError("60 requests in a row avoided the replica under test")


@pytest.mark.parametrize("stream", [False, True])
async def test_requests_held_by_a_replica_marked_down_are_retried_on_a_fallback(
    stream: bool,
) -> None:
    hung = FakeUpstream(header_gate=asyncio.Event())  # takes requests, never answers them
    well = FakeUpstream()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        hung_url = await stack.enter_async_context(serve(hung.app()))
        url = await _gateway_over(stack, ("hung", hung_url, hung), well)
        held = await _one_held_by(http, url, stream, hung)

        hung.health_ok = False  # its health polls now fail: the gateway marks it down
        status, body = await asyncio.wait_for(held, timeout=30)
        retries = await _metric(
            http, url, 'fleetgate_upstream_retries_total{reason="replica_down"'
        )
        async with http.get(f"{url}/admin/replicas", headers=ADMIN) as resp:
            health = {r["replica_id"]: r["healthy"] for r in (await resp.json())["replicas"]}

    assert status == 200, body
    if stream:
        assert body.endswith(b"data: [DONE]\n\n")
    assert hung.attempts == 1  # never retried on the replica that was marked down
    assert retries == 1
    assert health == {"hung": False, "well": True}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_replica_that_dies_holding_a_request_leaves_nothing_counted_in_flight(
    stream: bool,
) -> None:
    # A killed replica must come back with no request counted against it: a count leaked from
    # the requests it held when it died would make routing pass it over after its restart.
    gate = asyncio.Event()  # never set: the replica holds what it gets until it dies
    dying = FakeUpstream(stream_gate=gate) if stream else FakeUpstream(header_gate=gate)
    well = FakeUpstream()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        dying_server = AsyncExitStack()
        stack.push_async_callback(dying_server.aclose)  # if the test fails before it dies
        dying_url = await dying_server.enter_async_context(serve(dying.app()))
        url = await _gateway_over(stack, ("dying", dying_url, dying), well)

        async def inflight() -> dict[str, int]:
            async with http.get(f"{url}/admin/replicas", headers=ADMIN) as resp:
                return {r["replica_id"]: r["inflight_requests"]
                        for r in (await resp.json())["replicas"]}

        held = await _one_held_by(http, url, stream, dying)
        assert (await inflight())["dying"] == 1

        await dying_server.aclose()  # the replica dies with the request
        status, body = await asyncio.wait_for(held, timeout=30)

        async def nothing_in_flight() -> bool:
            return await inflight() == {"dying": 0, "well": 0}

        await wait_until(nothing_in_flight, "no request counted in flight on either replica")
    assert status == 200, body


@pytest.mark.parametrize("mode", ["hangs", "hangs-streaming", "answers-500"])
async def test_a_wedged_replica_answering_health_polls_stays_out_once_its_breaker_opens(
    mode: str,
) -> None:
    # An engine stuck in a kernel or a deadlocked scheduler behind an HTTP server that still
    # answers /health: each request sent there times out (or fails at once with a 500). Its
    # health polls must not close the circuit those failures opened, or it keeps half the
    # traffic, every request of it failing. Streamed, it still sends its 200 headers (vLLM does,
    # before the engine works): those are no success either.
    gate = asyncio.Event()  # never set
    stream = mode == "hangs-streaming"
    wedged = {
        "hangs": FakeUpstream(header_gate=gate),
        "hangs-streaming": FakeUpstream(event_gate=gate),
        "answers-500": FakeUpstream(fail_status=500),
    }[mode]
    well = FakeUpstream()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        wedged_url = await stack.enter_async_context(serve(wedged.app()))
        well_url = await stack.enter_async_context(serve(well.app()))
        specs = [
            ReplicaSpec("wedged", wedged_url, models=frozenset(wedged.models)),
            ReplicaSpec("well", well_url, models=frozenset(well.models)),
        ]
        cfg = GatewayConfig(
            health_interval_s=0.05, admin_key="adm", upstream_timeout_s=0.3,
            breaker_failures=2, breaker_cooldown_s=600,
        )
        url = await stack.enter_async_context(
            serve(create_app(cfg, GatewayPolicy.default(specs)), handler_cancellation=True)
        )
        statuses = []
        for i in range(12):
            body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}],
                    "stream": stream}
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
                await resp.read()
            await asyncio.sleep(0.15)  # health polls (every 50 ms) answer between requests
        async with http.get(f"{url}/admin/replicas", headers=ADMIN) as resp:
            circuits = {r["replica_id"]: r["circuit"] for r in (await resp.json())["replicas"]}

    assert wedged.attempts == 2, statuses  # the breaker's threshold, then never again
    if mode == "answers-500":  # each 500 was retried on the well replica
        assert statuses == [200] * 12
    else:
        assert statuses.count(504) == 2 and statuses.count(200) == 10, statuses
    assert circuits == {"wedged": "open", "well": "closed"}


@asynccontextmanager
async def _serve_on(app: web.Application, port: int) -> AsyncIterator[str]:
    """``serve``, on a given port: a replica restarted where it was."""
    runner = web.AppRunner(app, shutdown_timeout=5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_replica_refusing_a_connection_is_out_at_once_and_back_at_its_next_answered_poll(
) -> None:
    # The live review's finding 3: after its engine was killed, a replica stayed every gateway's
    # first choice until the breaker's threshold or two missed polls, each request paying a
    # retry. A connection refused means nothing listens there: the next ones would be refused.
    doomed, well = FakeUpstream(), FakeUpstream()
    port = free_port()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        doomed_server = AsyncExitStack()
        stack.push_async_callback(lambda: doomed_server.aclose())
        doomed_url = await doomed_server.enter_async_context(_serve_on(doomed.app(), port))
        well_url = await stack.enter_async_context(serve(well.app()))
        specs = [
            ReplicaSpec("doomed", doomed_url, models=frozenset(doomed.models)),
            ReplicaSpec("well", well_url, models=frozenset(well.models)),
        ]
        cfg = GatewayConfig(health_interval_s=3600, admin_key="adm")  # no poll meanwhile
        app = create_app(cfg, GatewayPolicy.default(specs, profile="round-robin"))
        url = await stack.enter_async_context(serve(app, handler_cancellation=True))
        registry = app[GATEWAY].registry

        def routable() -> dict[str, bool]:
            return {s.replica_id: s.healthy for s in registry.routable()}

        assert routable() == {"doomed": True, "well": True}
        await doomed_server.aclose()  # killed: its port refuses connections
        statuses = []
        for i in range(6):
            body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]}
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
        refused = await _metric(
            http, url, 'fleetgate_upstream_retries_total{reason="connect_failed"'
        )
        assert statuses == [200] * 6
        assert refused == 1  # refused once, then out of routing
        assert routable() == {"doomed": False, "well": True}

        # Restarted where it was: the next health poll it answers brings it back.
        doomed_server = AsyncExitStack()
        await doomed_server.enter_async_context(_serve_on(doomed.app(), port))
        await registry.poll_once(app[GATEWAY].http(), timeout_s=2.0)
        assert routable() == {"doomed": True, "well": True}
        for i in range(2):  # round-robin: one of the two goes to it
            body = {**CHAT, "messages": [{"role": "user", "content": f"again {i}"}]}
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
    assert len(doomed.received) == 1


async def test_a_lone_replica_that_refused_is_tried_again_as_soon_as_it_is_back() -> None:
    # The diff review: with no other replica, opening the circuit at once answered 503 for up
    # to a health-poll period after the engine was back (200 at once before). A lone replica
    # keeps the breaker's usual threshold.
    lone = FakeUpstream()
    port = free_port()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        server = AsyncExitStack()
        stack.push_async_callback(lambda: server.aclose())
        lone_url = await server.enter_async_context(_serve_on(lone.app(), port))
        specs = [ReplicaSpec("lone", lone_url, models=frozenset(lone.models))]
        cfg = GatewayConfig(health_interval_s=3600, admin_key="adm")  # no poll meanwhile
        url = await stack.enter_async_context(
            serve(create_app(cfg, GatewayPolicy.default(specs)), handler_cancellation=True)
        )
        await server.aclose()  # killed
        body = {**CHAT, "messages": [{"role": "user", "content": "while down"}]}
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 503
        server = AsyncExitStack()
        await server.enter_async_context(_serve_on(lone.app(), port))  # back, before any poll
        body = {**CHAT, "messages": [{"role": "user", "content": "back"}]}
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200


async def test_a_stream_gone_silent_on_a_replica_marked_down_ends_with_an_error_event() -> None:
    """The streaming review: a replica that stalled mid-stream (SIGSTOP) kept its client on the
    open stream for the whole upstream_timeout_s (600 s by default), though the gateway had
    marked it down seconds after. A stream silent since the replica's health polls began to
    fail now ends with the in-band error when it is marked down (it cannot be replayed: the
    client has its first tokens), and the engine's request is aborted."""
    stalled = FakeUpstream(stream_gate=asyncio.Event())  # first token, then nothing
    well = FakeUpstream()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        stalled_url = await stack.enter_async_context(serve(stalled.app()))
        url = await _gateway_over(stack, ("stalled", stalled_url, stalled), well)
        for _ in range(60):
            before = stalled.attempts
            resp = await stack.enter_async_context(
                http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True})
            )
            assert resp.status == 200
            first = await resp.content.readline()  # the first token's event, relayed
            assert first.startswith(b"data: {")
            if stalled.attempts > before:
                break
            await resp.read()  # the well replica's whole answer
        else:
            raise AssertionError("60 requests in a row avoided the replica under test")
        # Two polls answered after the first token: the next one, the first to fail, is sent
        # after the stream went silent (polls of one replica follow each other).
        answered = stalled.health_polls
        await wait_until(lambda: stalled.health_polls >= answered + 2, "two more health polls")
        stalled.health_ok = False  # its health polls now fail: the gateway marks it down
        async with asyncio.timeout(30):  # a hang guard, far under the 600 s timeout
            rest = await resp.read()
        await wait_until(stalled.client_gone.is_set, "the engine's request is aborted")
        errors_counted = await _metric(
            http, url, 'fleetgate_errors_total{code="upstream_error"'
        )
    assert b'"code": "upstream_error"' in rest and b"[DONE]" not in rest
    assert errors_counted == 1
