"""A minimal OpenAI-shaped upstream for gateway-mechanics tests (not a vLLM stand-in).

Tests about prefix hit rates use the real simulated replica (``replica/sim``); this fake only
answers in the shapes the gateway relays, records what it received, and lets a test hold a
response at a gate to observe streaming and disconnects without timing races.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

#: An aiohttp request handler.
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class FakeUpstream:
    """One fake replica. Flip the attributes to change its behaviour mid-test."""

    models: list[str] = field(default_factory=lambda: ["base-model"])
    adapters: dict[str, str] = field(default_factory=dict)
    #: What ``/v1/models`` reports for the base models, as vLLM does.
    max_model_len: int = 4096
    #: Close the connection without answering completions (a replica dying mid-request).
    drop_completions: bool = False
    #: When set, completions are answered with this status and vLLM's error body (an engine
    #: whose core died answers 500 to everything).
    fail_status: int | None = None
    #: False: ``/health`` answers 503 (a replica too busy to answer its health polls).
    health_ok: bool = True
    #: When set, a streaming response sends its first chunk, then waits for this gate.
    stream_gate: asyncio.Event | None = None
    #: When set, a response waits here before sending headers (upstream timeout tests).
    header_gate: asyncio.Event | None = None
    #: When set, a streamed response sends its headers, then waits here before its first
    #: event (as vLLM does: its 200 goes out before the engine works).
    event_gate: asyncio.Event | None = None
    cached_tokens: int = 0
    #: The prompt tokens its usage reports (token budgets settle their reservation to it).
    prompt_tokens: int = 10
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[CIMultiDict[str]] = field(default_factory=list)
    attempts: int = 0
    #: ``/health`` requests answered (the gateway's polls).
    health_polls: int = 0
    #: Set when the gateway went away while this upstream was streaming.
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)
    #: When set, ``/metrics`` reports 100 more output tokens at this many seconds apart at
    #: every scrape (``vllm:inter_token_latency_seconds``): the engine's decode pace.
    itl_s: float | None = None
    #: When set, ``/metrics`` reports this KV cache usage (``vllm:kv_cache_usage_perc``, 0..1).
    kv_usage: float | None = None
    #: What ``/metrics`` reports waiting to start (``vllm:num_requests_waiting``) ...
    waiting: int = 0
    #: ... and running (``vllm:num_requests_running``; None: 1 while ``itl_s`` is set, else 0).
    running: int | None = None
    _itl_sum_s: float = 0.0
    _itl_count: int = 0
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)
        return app

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA API, as far as the gateway's adapter registry calls it."""
        body = await request.json()
        self.adapters[body["lora_name"]] = self.models[0]
        return web.Response(text="Success")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.adapters.pop(body["lora_name"], None)
        return web.Response(text="Success")

    async def _health(self, request: web.Request) -> web.Response:
        self.health_polls += 1
        return web.Response(text="", status=200 if self.health_ok else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "parent": None, "max_model_len": self.max_model_len}
            for m in self.models
        ]
        data += [{"id": a, "object": "model", "parent": p} for a, p in self.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        # An engine that decodes tokens between scrapes (``itl_s``) runs requests: other
        # clients', beside this gateway's (flow control reads no pace off an idle engine).
        running = self.running if self.running is not None else int(self.itl_s is not None)
        text = (
            f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {self.waiting}\n"
        )
        if self.kv_usage is not None:
            text += f"vllm:kv_cache_usage_perc {self.kv_usage}\n"
        if self.itl_s is not None:
            self._itl_count += 100
            self._itl_sum_s += 100 * self.itl_s
            text += (
                f"vllm:inter_token_latency_seconds_sum {self._itl_sum_s}\n"
                f"vllm:inter_token_latency_seconds_count {self._itl_count}\n"
            )
        return web.Response(text=text)

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": 3,
            "total_tokens": self.prompt_tokens + 3,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.attempts += 1
        if self.drop_completions:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        body = await request.json()
        if self.fail_status is not None:
            error = {"message": "EngineCore encountered an issue.", "type": "InternalServerError"}
            return web.json_response(
                {"error": {**error, "code": self.fail_status}}, status=self.fail_status
            )
        self.received.append(body)
        self.headers.append(request.headers.copy())
        if self.header_gate is not None:
            await self.header_gate.wait()
        chat = request.path.endswith("chat/completions")
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "model": body["model"],
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "a b c"}}
                        if chat
                        else {"index": 0, "text": "a b c"}
                    ],
                    "usage": self._usage(body),
                }
            )
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        if self.event_gate is not None:
            await self.event_gate.wait()
        try:
            for i, word in enumerate(["a", " b", " c"]):
                delta = {"delta": {"content": word}} if chat else {"text": word}
                chunk = {
                    "id": "cmpl-1",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": body["model"],
                    "choices": [{"index": 0, **delta, "finish_reason": None}],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0 and self.stream_gate is not None:
                    await self._wait_or_notice_disconnect(request, resp)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": "cmpl-1", "choices": [], "usage": self._usage(body)}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.client_gone.set()
            raise
        return resp

    async def _wait_or_notice_disconnect(
        self, request: web.Request, resp: web.StreamResponse
    ) -> None:
        """Wait for the gate; a closed transport means the gateway aborted us."""
        assert self.stream_gate is not None
        gate = asyncio.ensure_future(self.stream_gate.wait())
        try:
            while not gate.done():
                transport = request.transport
                if transport is None or transport.is_closing():
                    self.client_gone.set()
                    raise ConnectionResetError("gateway closed the connection")
                await asyncio.wait({gate}, timeout=0.02)
        finally:
            gate.cancel()


@asynccontextmanager
async def serve(app: web.Application, handler_cancellation: bool = False) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1, port 0; yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def engine_app(model: str, posts: dict[str, Handler]) -> web.Application:
    """A bare engine: /health, /v1/models listing ``model``, idle /metrics, and ``posts``
    (path -> handler), for tests that script one endpoint's answer."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "parent": None}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    return app
