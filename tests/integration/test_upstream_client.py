"""The gateway's lean upstream HTTP/1.1 client, against real servers on real sockets.

aiohttp servers stand in for vLLM's HTTP server where the answer is well-formed; raw asyncio
servers play a replica that misbehaves (dies mid-answer, says nothing, closes early).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from yarl import URL

from gateway.upstream_client import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPayloadError,
    UpstreamPool,
)
from tests.support.redis_server import free_port

pytestmark = pytest.mark.asyncio

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve_app(handler: Handler) -> tuple[web.AppRunner, URL]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, URL(f"http://127.0.0.1:{port}/v1/chat/completions")


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    upstream = UpstreamPool(connect_timeout_s=2.0)
    yield upstream
    await upstream.close()


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {
            "echo": json.loads(body),
            "request_id": request.headers.get("X-Request-Id"),
            "peer": request.transport.get_extra_info("peername")[1] if request.transport else 0,
        },
        headers={"X-Engine": "test"},
    )


async def test_post_returns_status_headers_and_body_and_reuses_the_connection(
    pool: UpstreamPool,
) -> None:
    runner, url = await _serve_app(_echo)
    try:
        peers = []
        for i in range(3):
            payload = json.dumps({"n": i}).encode()
            async with pool.post(url, payload, {"X-Request-Id": f"r{i}"}) as resp:
                assert resp.status == 200
                assert ("X-Engine", "test") in resp.headers
                answer = json.loads(await resp.read())
            assert answer["echo"] == {"n": i}
            assert answer["request_id"] == f"r{i}"
            peers.append(answer["peer"])
        assert len(set(peers)) == 1, "keep-alive: one connection serves all three requests"
        assert pool.open_connections == 1
    finally:
        await runner.cleanup()


async def test_concurrent_requests_each_get_their_own_answer(pool: UpstreamPool) -> None:
    async def slow_echo(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        await asyncio.sleep(0.01 * (body["n"] % 3))
        return web.json_response(body)

    runner, url = await _serve_app(slow_echo)
    try:

        async def one(n: int) -> dict[str, int]:
            async with pool.post(url, json.dumps({"n": n}).encode(), {}) as resp:
                return json.loads(await resp.read())

        answers = await asyncio.gather(*(one(n) for n in range(20)))
        assert [a["n"] for a in answers] == list(range(20))
    finally:
        await runner.cleanup()


async def test_a_chunked_stream_arrives_piece_by_piece(pool: UpstreamPool) -> None:
    release = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: 1\n\n")
        await release.wait()  # the second event waits until the client has the first
        await out.write(b"data: 2\n\n")
        await out.write_eof()
        return out

    runner, url = await _serve_app(stream)
    try:
        async with pool.post(url, b"{}", {}, read_timeout_s=5) as resp:
            chunks = resp.iter_any()
            assert await anext(chunks) == b"data: 1\n\n"
            release.set()
            rest = b"".join([chunk async for chunk in chunks])
        assert rest == b"data: 2\n\n"
        assert pool.open_connections == 1  # fully read: kept for the next request
    finally:
        await runner.cleanup()


Connection = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _listen(handle: Connection) -> tuple[asyncio.Server, URL]:
    """A raw asyncio server on a free port running ``handle`` per connection; its URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, URL(f"http://127.0.0.1:{port}/v1/chat/completions")


async def _raw_server(on_request: Connection) -> tuple[asyncio.Server, URL]:
    """One request per connection: the head is read, then ``on_request`` answers (or not)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the request head; bodies here are tiny
        try:
            await on_request(reader, writer)
        finally:
            writer.close()

    return await _listen(handle)


async def test_a_close_delimited_body_ends_with_the_connection(pool: UpstreamPool) -> None:
    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"ok": true}')
        await writer.drain()

    server, url = await _raw_server(answer)
    async with server:
        async with pool.post(url, b"{}", {}) as resp:
            assert json.loads(await resp.read()) == {"ok": True}
        assert pool.open_connections == 0  # the server closed it: not pooled


async def test_connection_closed_before_headers_is_a_disconnect(pool: UpstreamPool) -> None:
    async def die(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return  # close without a byte

    server, url = await _raw_server(die)
    async with server:
        with pytest.raises(UpstreamDisconnected):
            async with pool.post(url, b"{}", {}):
                pass
        # A ConnectionError: the proxy's retry rule treats it as "never answered".
        assert issubclass(UpstreamDisconnected, ConnectionError)


async def test_body_broken_off_after_the_headers_is_a_payload_error(pool: UpstreamPool) -> None:
    async def half(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial":')
        await writer.drain()

    server, url = await _raw_server(half)
    async with server:
        async with pool.post(url, b"{}", {}) as resp:
            assert resp.status == 200
            with pytest.raises(UpstreamPayloadError):
                await resp.read()
        assert pool.open_connections == 0


async def test_garbage_instead_of_http_is_a_disconnect(pool: UpstreamPool) -> None:
    async def garbage(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)

    server, url = await _raw_server(garbage)
    async with server:
        with pytest.raises(UpstreamDisconnected, match="malformed"):
            async with pool.post(url, b"{}", {}, read_timeout_s=2):
                pass


async def test_silence_past_the_read_timeout_raises_timeout(pool: UpstreamPool) -> None:
    async def silent(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()  # say nothing until the client gives up and closes

    server, url = await _raw_server(silent)
    async with server:
        with pytest.raises(TimeoutError):
            async with pool.post(url, b"{}", {}, read_timeout_s=0.2):
                pass
        assert pool.open_connections == 0  # a timed-out connection is never reused


async def test_refused_connection_is_a_connect_error(pool: UpstreamPool) -> None:
    url = URL(f"http://127.0.0.1:{free_port()}/v1/chat/completions")
    with pytest.raises(UpstreamConnectError):
        async with pool.post(url, b"{}", {}):
            pass
    assert issubclass(UpstreamConnectError, ConnectionError)


async def test_leaving_early_closes_the_connection_so_the_engine_sees_it(
    pool: UpstreamPool,
) -> None:
    disconnected = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse()
        await out.prepare(request)
        try:
            while True:
                await out.write(b"data: tick\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            disconnected.set()
            raise

    runner, url = await _serve_app(endless)
    try:
        async with pool.post(url, b"{}", {}) as resp:
            async for _chunk in resp.iter_any():
                break  # one chunk, then walk away
        await asyncio.wait_for(disconnected.wait(), 5)
        assert pool.open_connections == 0
    finally:
        await runner.cleanup()


class _Clock:
    """A monotonic clock the test moves by hand: idle timeouts without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_idle_connections_past_the_idle_timeout_are_not_reused() -> None:
    clock = _Clock()
    pool = UpstreamPool(idle_timeout_s=4.0, clock=clock)
    runner, url = await _serve_app(_echo)
    try:
        async with pool.post(url, b"{}", {}) as resp:
            first = json.loads(await resp.read())["peer"]
        clock.now += 3.9  # still within the timeout: the same connection
        async with pool.post(url, b"{}", {}) as resp:
            again = json.loads(await resp.read())["peer"]
        assert again == first
        clock.now += 4.0  # idle for the whole timeout: a new connection
        async with pool.post(url, b"{}", {}) as resp:
            second = json.loads(await resp.read())["peer"]
        assert first != second
    finally:
        await pool.close()
        await runner.cleanup()


async def test_header_injection_is_refused_before_anything_is_sent(pool: UpstreamPool) -> None:
    runner, url = await _serve_app(_echo)
    try:
        with pytest.raises(ValueError, match="CR, LF"):
            async with pool.post(url, b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"}):
                pass
        assert pool.open_connections == 0
    finally:
        await runner.cleanup()


async def test_a_large_body_read_slowly_is_complete(pool: UpstreamPool) -> None:
    big = b"x" * (2 * 1024 * 1024)  # past the high-water mark: reading pauses and resumes

    async def large(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=big)

    runner, url = await _serve_app(large)
    try:
        async with pool.post(url, b"{}", {}) as resp:
            got = bytearray()
            async for chunk in resp.iter_any():
                got += chunk
                await asyncio.sleep(0.001)
        assert bytes(got) == big
    finally:
        await runner.cleanup()


async def test_a_closed_pool_refuses_new_requests() -> None:
    pool = UpstreamPool()
    await pool.close()
    with pytest.raises(UpstreamConnectError, match="closed"):
        async with pool.post(URL("http://127.0.0.1:1/x"), b"{}", {}):
            pass


# --------------------------------------------------------------------------- review findings


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's body (the head was read by ``_raw_server``'s handler or here)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


async def _keepalive_server(
    answer: Callable[[bytes, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, URL]:
    """A raw keep-alive server: ``answer(body, writer)`` for each request of each connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    body = await _read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                await answer(body, writer)
        finally:
            writer.close()

    return await _listen(handle)


async def test_interim_1xx_answers_are_skipped_and_never_leak_into_the_next_request(
    pool: UpstreamPool,
) -> None:
    async def answer(body: bytes, writer: asyncio.StreamWriter) -> None:
        if body == b"A":  # a proxy in front of the engine forwards Early Hints first
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nanswer-" + body)
        await writer.drain()

    server, url = await _keepalive_server(answer)
    async with server:
        async with pool.post(url, b"A", {}, read_timeout_s=2) as resp:
            assert (resp.status, await resp.read()) == (200, b"answer-A")
            assert ("Link", "</x>") not in resp.headers
        async with pool.post(url, b"B", {}, read_timeout_s=2) as resp:
            assert (resp.status, await resp.read()) == (200, b"answer-B")
        assert pool.open_connections == 1  # the same connection served both


async def test_an_upgrade_answer_drops_the_connection(pool: UpstreamPool) -> None:
    async def upgrade(body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
        )
        await writer.drain()

    server, url = await _keepalive_server(upgrade)
    async with server:
        with pytest.raises(UpstreamDisconnected):
            async with pool.post(url, b"{}", {}, read_timeout_s=2):
                pass
        assert pool.open_connections == 0


async def test_a_connection_the_engine_closed_is_not_handed_out_before_connection_lost(
    pool: UpstreamPool,
) -> None:
    """The engine's FIN and connection_lost are a loop turn apart: no request in between."""

    async def answer_then_close(
        _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)  # the engine's keep-alive timer fires: it closes

    server, url = await _raw_server(answer_then_close)
    async with server:
        async with pool.post(url, b"a", {}) as resp:
            assert await resp.read() == b"ok"
        conn = pool._idle[("http", "127.0.0.1", url.port or 0)][0]
        eof = asyncio.Event()
        original = conn.eof_received

        def on_eof() -> bool:
            eof.set()
            return original()

        async def next_request() -> bytes:
            # Woken by the FIN itself, before connection_lost runs (a loop turn later): the
            # race of a handler that was already scheduled when the engine closed.
            await eof.wait()
            async with pool.post(url, b"b", {}, read_timeout_s=2) as resp:
                return await resp.read()

        waiting = asyncio.create_task(next_request())
        await asyncio.sleep(0)  # it waits on the event now
        conn.eof_received = on_eof  # type: ignore[method-assign]
        assert await asyncio.wait_for(waiting, 5) == b"ok"


async def test_stray_bytes_after_a_complete_answer_keep_the_answer_but_drop_the_connection(
    pool: UpstreamPool,
) -> None:
    async def extra(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokGARBAGE")
        await writer.drain()
        await asyncio.sleep(0.05)

    server, url = await _raw_server(extra)
    async with server:
        async with pool.post(url, b"{}", {}) as resp:
            assert await resp.read() == b"ok"
        assert pool.open_connections == 0


async def test_close_idle_closes_connections_past_the_idle_timeout() -> None:
    clock = _Clock()
    pool = UpstreamPool(idle_timeout_s=4.0, clock=clock)
    runner, url = await _serve_app(_echo)
    try:

        async def one() -> None:
            async with pool.post(url, b"{}", {}) as resp:
                await resp.read()

        await asyncio.gather(*(one() for _ in range(4)))  # four connections, all idle after
        assert pool.open_connections == 4
        assert pool.close_idle() == 4  # not idle long enough yet
        clock.now += 4.0
        assert pool.close_idle() == 0
    finally:
        await pool.close()
        await runner.cleanup()


async def test_a_reused_connection_closed_without_an_answer_is_retried_once_on_a_fresh_one(
    pool: UpstreamPool,
) -> None:
    """The keep-alive race: the engine drops an idle connection as the next request goes out.
    The request goes again on a new connection, not to another replica (with one replica, that
    was a 503 for a healthy engine). A fresh connection that dies is not retried (above)."""
    requests_per_connection: dict[int, int] = {}

    async def answer(body: bytes, writer: asyncio.StreamWriter) -> None:
        served = requests_per_connection.get(id(writer), 0) + 1
        requests_per_connection[id(writer)] = served
        if served == 2:
            writer.close()  # the second request on a connection: closed without a byte
            return
        reply = json.dumps({"echo": body.decode()}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(reply) + reply)
        await writer.drain()

    server, url = await _keepalive_server(answer)
    async with server:
        for body in (b"first", b"second"):
            async with pool.post(url, body, {}) as resp:
                assert json.loads(await resp.read()) == {"echo": body.decode()}
    # The second request: once on the reused connection (dropped), once on a new one.
    assert sorted(requests_per_connection.values()) == [1, 2]
