"""A streaming client that stops reading, its connection open, on real sockets.

The load review: such a client held its request in flight (the HPA's metric, routing's load)
and its engine generating, until it disconnected; nothing timed it out. Past
``client_stall_timeout_s`` without reading, it is now dropped as a client that left: the
engine's request is aborted and the gateway counts a 499."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from tests.integration.test_gateway_support import engine_app, serve
from tests.support.polling import wait_until

MODEL = "base-model"


def _endless(aborted: asyncio.Event) -> web.Application:
    """Streams 1 KiB token events until the gateway closes the connection."""

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": "x" * 1024}}]}
        event = f"data: {json.dumps(chunk)}\n\n".encode()
        try:
            while True:
                await resp.write(event)
                await asyncio.sleep(0)
                if request.transport is None or request.transport.is_closing():
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        aborted.set()
        return resp

    return engine_app(MODEL, {"/v1/chat/completions": chat})


async def test_a_client_that_stops_reading_is_dropped_and_its_engine_request_aborted() -> None:
    aborted = asyncio.Event()
    async with serve(_endless(aborted)) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        config = GatewayConfig(health_interval_s=3600, client_stall_timeout_s=0.5)
        async with serve(create_app(config, GatewayPolicy.default([spec]))) as url:
            host, port = url.removeprefix("http://").split(":")
            # A client with a small receive buffer that sends its request and never reads.
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, (host, int(port)))
            body = json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            ).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            await loop.sock_sendall(sock, head + body)
            try:
                async with asyncio.timeout(60):  # a hang guard, not a timing assertion
                    await aborted.wait()

                async def counted_499() -> bool:
                    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
                        text = await r.text()
                    return any(
                        line.startswith("fleetgate_requests_total{")
                        and 'status="499"' in line
                        for line in text.splitlines()
                    )

                await wait_until(counted_499, "the stalled client counted as a 499")
            finally:
                sock.close()
