"""A lean HTTP/1.1 client for the one call on every request's path: the POST to a replica.

Why not aiohttp's client here (it still serves health polls and adapter loads): at concurrency
1 its request machinery (``ClientRequest``/``ClientResponse`` objects, a body-writer task,
trace hooks, cookie and redirect handling the gateway never uses) added about 0.35 ms per
request on the benchmark machine, more than the gateway's own routing work. This client does
only what the proxy needs: keep-alive connections per origin, one ``write`` per request, the
response parsed by ``httptools`` (llhttp, the parser uvicorn and thus vLLM's server use), the
body handed over as it arrives, with a read timeout per wait.

Failure semantics, which the proxy's retry rules rely on:

* ``UpstreamConnectError``: the connection could not be made (refused, unreachable, connect
  timeout). The replica never saw the request: safe to try a fallback.
* ``UpstreamDisconnected``: the connection closed before the response's status line and
  headers were complete. As with aiohttp's ``ServerDisconnectedError``, the proxy retries
  elsewhere (an engine that dies before answering has not streamed anything).
* ``UpstreamPayloadError``: the body broke off after the headers (the response is partial).
* ``TimeoutError``: no byte arrived within ``read_timeout_s`` of a wait (headers or next chunk).

Leaving ``post``'s context with the response fully read returns the connection to the pool;
leaving it any other way (an error, a client that went away, ``close()``) closes the connection,
so the engine sees the disconnect and aborts the generation.

Idle connections are reused newest first and dropped ``idle_timeout_s`` after the answer's last
byte (4 s by default: below uvicorn's 5 s keep-alive, so the gateway, not the engine, closes an
idle connection and a request does not race the engine's close); the check runs when a
connection is taken or released and from ``close_idle`` (the gateway's health loop). A connection
whose engine closed its side is never handed out again (``eof_received``). A reused connection
that closes before a single byte of the answer is the keep-alive race all the same (the engine's
timer fired while the request was on its way, or a loaded engine dropped its idle sockets): the
request is sent once more on a fresh connection, as HTTP clients do, instead of failing over to
another replica or, with one replica, failing. Interim answers
(100 Continue, 103 Early Hints from a proxy in front of the engine) are skipped; a 101 upgrade
drops the connection.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import cast

import httptools
from yarl import URL

__all__ = [
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamPayloadError",
    "UpstreamPool",
    "UpstreamResponse",
]

#: Buffered body bytes past which the connection stops reading (a slow client must not make the
#: gateway hold a whole generation in memory); reading resumes once the reader drained them.
_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """Base of the errors this client raises (besides ``TimeoutError``)."""


class UpstreamConnectError(UpstreamError, ConnectionError):
    """No connection could be made: the replica never saw the request.

    ``refused``: the host answered that nothing listens on the port (a killed or restarting
    engine), as opposed to a connect timeout or an unreachable network, which say less.
    """

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class UpstreamDisconnected(UpstreamError, ConnectionError):
    """The connection closed before the response headers were complete."""


class UpstreamPayloadError(UpstreamError):
    """The response body broke off (connection lost or malformed) after the headers."""


class UpstreamResponse:
    """One response: ``status``, ``headers`` (name, value pairs), then the body."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_keep_alive",
        "_loop",
        "_read_timeout_s",
        "_waiter",
        "close_delimited",
        "completed_at",
        "headers",
        "headers_done",
        "raw_headers",
        "status",
    )

    def __init__(
        self, conn: _Connection, loop: asyncio.AbstractEventLoop, read_timeout_s: float | None
    ) -> None:
        self._conn = conn
        self._loop = loop
        self._read_timeout_s = read_timeout_s
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: list[tuple[str, str]] = []
        self.headers_done = False
        #: No Content-Length and not chunked: the body ends when the connection does.
        self.close_delimited = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        #: When the last byte arrived (the engine's keep-alive timer starts then).
        self.completed_at = 0.0

    # -- called by the connection (parser callbacks, connection loss) -------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_headers(self, status: int) -> None:
        self.status = status
        headers = [
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in self.raw_headers
        ]
        self.headers = headers
        lowered = {name.lower(): value for name, value in headers}
        self.close_delimited = (
            "content-length" not in lowered
            and "chunked" not in lowered.get("transfer-encoding", "").lower()
        )
        self.headers_done = True
        self._wake()

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _on_complete(self, keep_alive: bool) -> None:
        self._done = True
        self._keep_alive = keep_alive
        self.completed_at = self._conn.clock()
        self._wake()

    def _on_lost(self, exc: BaseException | None) -> None:
        if self._done:
            return
        if self.headers_done and self.close_delimited and exc is None:
            self._done = True  # a body delimited by the connection's end: complete
        elif not self.headers_done:
            self._error = UpstreamDisconnected(
                f"connection closed before the response headers{_reason(exc)}"
            )
        else:
            self._error = UpstreamPayloadError(f"response body broke off{_reason(exc)}")
        self._wake()

    def _on_parse_error(self, exc: Exception) -> None:
        if self._done:
            return  # stray bytes after a complete answer: the connection is dropped, not the answer
        if self.headers_done:
            self._error = UpstreamPayloadError(f"malformed response body: {exc}")
        else:
            self._error = UpstreamDisconnected(f"malformed response head: {exc}")
        self._wake()

    # -- waiting ---------------------------------------------------------------------------------

    async def _wait(self) -> None:
        """Wait for the next parser event, within the read timeout."""
        waiter = self._waiter = self._loop.create_future()
        try:
            if self._read_timeout_s is None:
                await waiter
            else:
                async with asyncio.timeout(self._read_timeout_s):
                    await waiter
        finally:
            self._waiter = None

    async def _wait_headers(self) -> None:
        while not self.headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._error is not None and not self.headers_done:
            raise self._error

    # -- the body --------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """The whole body has arrived (and been handed over or buffered)."""
        return self._done

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        async for chunk in self.iter_any():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (each item: whatever was buffered, joined)."""
        while True:
            if self._chunks:
                chunks = self._chunks
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                self._conn.resume_reading()
                yield data
                continue
            if self._error is not None:
                raise self._error
            if self._done:
                return
            await self._wait()

    def close(self) -> None:
        """Abandon the response: the connection is closed (the engine aborts the request)."""
        self._conn.abort()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one response at a time."""

    def __init__(self, pool: UpstreamPool, origin: tuple[str, str, int]) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: UpstreamResponse | None = None
        self._paused = False
        #: An interim (1xx) response is being parsed: its end is not the answer's end.
        self._interim = False
        self.closed = False
        self.clock = pool.clock
        self.idle_since = 0.0
        #: Requests sent on this connection, and bytes received for the current one.
        self.requests_sent = 0
        self.bytes_in = 0

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.bytes_in += len(data)
        response = self._response
        if response is None:
            self.abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # HttpParserError, HttpParserUpgrade (a 101), a callback's bug
            response._on_parse_error(exc)
            self.abort()

    def eof_received(self) -> bool:
        # The engine closed its side: never hand this connection out again, from now on (the
        # transport reports connection_lost only on a later loop turn).
        self.closed = True
        self._pool._forget(self)
        return False  # close our side too; connection_lost reports the end of the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool._forget(self)
        response = self._response
        if response is not None:
            response._on_lost(exc)

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # 100 Continue, 103 Early Hints (a proxy in front of the engine may forward them):
            # interim answers, followed by the real one on the same connection. (A 101 makes
            # the parser raise HttpParserUpgrade: the connection is dropped.)
            self._interim = True
            response.raw_headers.clear()
            return
        response._on_headers(status)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._on_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self._response is not None:
            self._response._on_complete(self._parser.should_keep_alive())

    # -- used by the pool and the response -------------------------------------------------------

    def start(self, response: UpstreamResponse, request: bytes) -> None:
        self._response = response
        if self.transport is None or self.closed:
            raise UpstreamDisconnected("the connection closed before the request was sent")
        self.requests_sent += 1
        self.bytes_in = 0
        self.transport.write(request)

    def finish(self, response: UpstreamResponse) -> bool:
        """Detach ``response``; True if the connection may serve another request."""
        self._response = None
        if self._paused:
            self.resume_reading()
        return (
            not self.closed
            and response._done
            and response._error is None
            and response._keep_alive
            and not response._chunks  # every byte handed over (nothing left mid-read)
        )

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True
        self._pool._forget(self)  # now, not when connection_lost runs on a later loop turn


def _reason(exc: BaseException | None) -> str:
    return f": {type(exc).__name__}: {exc}" if exc is not None else ""


def _check_header(name: str, value: str) -> None:
    if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
        raise ValueError(f"invalid header {name!r}: CR, LF (or ':' in a name) not allowed")


class UpstreamPool:
    """Keep-alive connections to replicas, and ``post`` to send one request on one of them."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        idle_timeout_s: float = 4.0,
        max_idle_per_origin: int = 256,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        #: Time source for the idle timeout (tests inject one instead of sleeping).
        self.clock = clock
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self._ssl_context = ssl_context  # made once, on the first https origin, if not given
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._heads: dict[tuple[str, str], bytes] = {}
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections open now (idle or serving a request)."""
        return len(self._open)

    def post(
        self,
        url: URL,
        body: bytes,
        headers: Mapping[str, str],
        *,
        read_timeout_s: float | None = None,
    ) -> _Exchange:
        """``async with pool.post(url, body, headers) as response:`` one POST request.

        Entering sends the request and waits for the status line and headers; the body is read
        inside the block (``read`` or ``iter_any``).
        """
        return _Exchange(self, url, body, headers, read_timeout_s)

    async def close(self) -> None:
        """Close every connection; later ``post`` calls fail."""
        self._closed = True
        for conn in list(self._open):
            conn.abort()
        self._open.clear()
        self._idle.clear()

    # -- internals -------------------------------------------------------------------------------

    def _request_head(self, url: URL, length: int, headers: Mapping[str, str]) -> bytes:
        key = (url.raw_path_qs, url.host_port_subcomponent or url.raw_host or "")
        fixed = self._heads.get(key)
        if fixed is None:
            if len(self._heads) > 4096:  # replicas come and go: keep the cache bounded
                self._heads.clear()
            fixed = self._heads[key] = (
                f"POST {key[0] or '/'} HTTP/1.1\r\nHost: {key[1]}\r\n".encode("latin-1")
            )
        lines = [fixed, b"Content-Length: %d\r\n" % length]
        for name, value in headers.items():
            _check_header(name, value)
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _acquire(self, url: URL) -> _Connection:
        if self._closed:
            raise UpstreamConnectError("the upstream pool is closed")
        scheme = url.scheme
        host = url.raw_host or ""
        port = url.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        idle = self._idle.get(origin)
        if idle:
            now = self.clock()
            while idle:
                conn = idle.pop()  # newest first: the warmest connection
                if (
                    not conn.closed
                    and now - conn.idle_since < self.idle_timeout_s
                    and not (conn.transport is not None and conn.transport.is_closing())
                ):
                    return conn
                conn.abort()
        return await self._connect(origin)

    async def _connect(self, origin: tuple[str, str, int]) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()  # loads the CA store: once
            context = self._ssl_context
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin), host, port, ssl=context
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connecting to {host}:{port} took longer than {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            # A host name with several addresses that all refuse raises a plain OSError
            # ("Multiple exceptions") on Python 3.11: not taken as refused, the usual rules apply.
            raise UpstreamConnectError(
                f"cannot connect to {host}:{port}: {exc}",
                refused=isinstance(exc, ConnectionRefusedError),
            ) from exc
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection, response: UpstreamResponse) -> None:
        if not conn.finish(response) or self._closed:
            conn.abort()
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.max_idle_per_origin:
            conn.abort()
            return
        # Idle since the answer's last byte, when the engine's keep-alive timer started (the
        # relay to a slow client may have taken longer).
        conn.idle_since = response.completed_at or self.clock()
        idle.append(conn)
        self._trim(idle, self.clock())

    def _trim(self, idle: list[_Connection], now: float) -> None:
        """Close the oldest idle connections past ``idle_timeout_s`` (the list is oldest first)."""
        while idle and now - idle[0].idle_since >= self.idle_timeout_s:
            idle.pop(0).abort()

    def close_idle(self) -> int:
        """Close every idle connection past ``idle_timeout_s``; how many are left open.

        The gateway calls it from its health loop, so connections to a replica that stopped
        getting traffic (or vanished without closing them) do not stay open.
        """
        now = self.clock()
        for idle in list(self._idle.values()):
            self._trim(idle, now)
        return len(self._open)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)


class _Exchange:
    """The context manager ``UpstreamPool.post`` returns."""

    __slots__ = ("_body", "_conn", "_headers", "_pool", "_read_timeout_s", "_response", "_url")

    def __init__(
        self,
        pool: UpstreamPool,
        url: URL,
        body: bytes,
        headers: Mapping[str, str],
        read_timeout_s: float | None,
    ) -> None:
        self._pool = pool
        self._url = url
        self._body = body
        self._headers = headers
        self._read_timeout_s = read_timeout_s
        self._conn: _Connection | None = None
        self._response: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        pool = self._pool
        request = pool._request_head(self._url, len(self._body), self._headers) + self._body
        conn = await pool._acquire(self._url)
        reused = conn.requests_sent > 0
        try:
            return await self._send(conn, request)
        except UpstreamDisconnected:
            if not reused or conn.bytes_in:
                raise
        # A reused connection closed without answering: the keep-alive race, not the engine.
        return await self._send(await pool._connect(conn.origin), request)

    async def _send(self, conn: _Connection, request: bytes) -> UpstreamResponse:
        self._conn = conn
        response = self._response = UpstreamResponse(
            conn, asyncio.get_running_loop(), self._read_timeout_s
        )
        try:
            conn.start(response, request)
            await response._wait_headers()
        except BaseException:
            conn.finish(response)
            conn.abort()
            raise
        return response

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn, response = self._conn, self._response
        if conn is None or response is None:
            return
        if exc_type is not None:
            conn.finish(response)
            conn.abort()
            return
        self._pool._release(conn, response)
