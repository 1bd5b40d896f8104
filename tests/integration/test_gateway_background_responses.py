"""Background Responses are accounted when they end: the engine answers ``status: "queued"``
at once and generates on, so the tokens come from the finished response the gateway reads from
the replica that holds it, not from the first answer (which reports none)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.state import GATEWAY
from tests.integration.test_gateway_support import engine_app, serve
from tests.support.polling import wait_until

MODEL = "base-model"
USAGE = {"input_tokens": 30, "output_tokens": 12, "total_tokens": 42}


class BackgroundEngine:
    """vLLM's background mode: POST answers "queued" with no usage; GET shows the response
    "in_progress" until ``done`` is set, then "completed" with its usage (or 404 when
    ``forget``: an engine that restarted)."""

    def __init__(self, forget: bool = False, final_status: str = "completed") -> None:
        self.forget = forget
        self.final_status = final_status
        self.done = False
        self.reads = 0
        self.release = asyncio.Event()

    def app(self) -> web.Application:
        app = engine_app(MODEL, {"/v1/responses": self._create})
        app.router.add_get("/v1/responses/{response_id}", self._retrieve)
        return app

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            # Streamed background: the engine's task generates on whatever the client does.
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            created = {"id": body["request_id"], "object": "response", "status": "queued"}
            await resp.write(
                b"event: response.created\ndata: "
                + json.dumps({"type": "response.created", "response": created}).encode()
                + b"\n\n"
            )
            await self.release.wait()
            return resp
        return web.json_response(
            {
                "id": body["request_id"],
                "object": "response",
                "status": "queued",
                "background": True,
                "model": MODEL,
                "output": [],
                "usage": None,
            }
        )

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("stream") == "true":
            return await self._stream(request)
        self.reads += 1
        if self.forget:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.json_response(
            {
                "id": request.match_info["response_id"],
                "object": "response",
                "status": self.final_status if self.done else "in_progress",
                "usage": USAGE if self.done else None,
            }
        )


    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """vLLM streams a background response while it generates: one delta now, the end once
        ``release`` is set."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: response.output_text.delta\ndata: {"delta": "a"}\n\n')
        await self.release.wait()
        await resp.write(b'event: response.completed\ndata: {"status": "completed"}\n\n')
        await resp.write_eof()
        return resp


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        return await resp.text()


async def _run(engine: BackgroundEngine) -> tuple[Any, str, str]:
    """One background request through a gateway: (the first answer, /metrics while the engine
    still generates, /metrics once it is accounted)."""
    async with serve(engine.app()) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app) as url:
            app[GATEWAY].background_responses.interval_s = 0.02
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            first = await client.responses.create(model=MODEL, input="hi", background=True)
            await client.close()
            # A forgotten response is settled at the first read; a running one is read on.
            reads = 1 if engine.forget else 2
            await wait_until(lambda: engine.reads >= reads, "the gateway to read the response")
            running = await _metrics(url)
            engine.done = True

            async def accounted() -> bool:
                return _metric(await _metrics(url), "fleetgate_requests_total") == 1

            await wait_until(accounted, "the background response to be accounted")
            assert len(app[GATEWAY].background_responses) == 0
            return first, running, await _metrics(url)


async def test_a_background_response_is_charged_its_usage_once_it_ends() -> None:
    first, running, ended = await _run(BackgroundEngine())
    assert first.status == "queued"
    # Not accounted while the engine generates (the first answer has no usage) ...
    assert _metric(running, "fleetgate_requests_total") == 0
    # ... then once, with the finished response's tokens.
    assert _metric(ended, "fleetgate_prompt_tokens_total") == 30
    assert _metric(ended, "fleetgate_completion_tokens_total") == 12


async def test_a_background_response_its_replica_forgot_is_settled_without_usage() -> None:
    _, _, ended = await _run(BackgroundEngine(forget=True))
    assert _metric(ended, "fleetgate_prompt_tokens_total") == 0


async def test_a_streamed_retrieve_is_relayed_as_the_engine_sends_it() -> None:
    # GET /v1/responses/{id}?stream=true of a running background response: each event reaches
    # the client when the engine sends it (it used to be held until the response ended).
    engine = BackgroundEngine()
    async with serve(engine.app()) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            first = await client.responses.create(model=MODEL, input="hi", background=True)
            await client.close()
            async with aiohttp.ClientSession() as http, http.get(
                f"{url}/v1/responses/{first.id}", params={"stream": "true"}
            ) as resp:
                assert resp.status == 200
                assert resp.content_type == "text/event-stream"
                # Bounded only so that a gateway holding the stream fails instead of hanging.
                head = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30)
                assert b"response.output_text.delta" in head  # before the engine is released
                engine.release.set()
                rest = await resp.read()
            assert b"response.completed" in rest


async def test_a_streamed_background_response_left_early_is_still_charged_when_it_ends() -> None:
    # background + stream: vLLM generates in its own task; a client that hangs up after the
    # first event does not stop it (and may fetch the result later), so it must still be charged.
    engine = BackgroundEngine()
    async with serve(engine.app()) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app, handler_cancellation=True) as url:
            app[GATEWAY].background_responses.interval_s = 0.02
            body = {"model": MODEL, "input": "hi", "background": True, "stream": True}
            async with aiohttp.ClientSession() as http, http.post(
                f"{url}/v1/responses", json=body
            ) as resp:
                assert b"response.created" in await resp.content.readuntil(b"\n\n")
            # The client is gone; the engine's task goes on and ends later.
            await wait_until(lambda: engine.reads >= 1, "the gateway to watch the response")
            engine.done = True
            engine.release.set()

            async def charged() -> bool:
                return _metric(await _metrics(url), "fleetgate_completion_tokens_total") == 12

            await wait_until(charged, "the streamed background response to be charged")


async def test_a_background_response_the_engine_failed_is_an_upstream_error() -> None:
    _, _, ended = await _run(BackgroundEngine(final_status="failed"))
    assert 'status="502"' in ended
    assert _metric(ended, "fleetgate_requests_total") == 1
