"""Fields the gateway owns on every API (real sockets, a fake engine that records bodies):
``priority`` (the tenant's class decides it) and ``cache_salt`` (the tenant's salt decides it).
A client's own would let one tenant jump the engine's queue, or share another's cached
prefixes: a tenant's derived salt is no secret."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.state import GATEWAY
from routing.config.tenancy import derive_cache_salt
from tests.integration.test_gateway_support import FakeUpstream, serve

#: Every API with a JSON body the gateway relays, and a minimal body for it.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"input": "hi"},
    "/pooling": {"input": "hi"},
    "/score": {"text_1": "a", "text_2": "b"},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
    "/classify": {"input": "hi"},
    "/v2/embed": {"texts": ["hi"], "input_type": "search_document"},
    "/tokenize": {"prompt": "hi"},
}
#: The APIs that prefill nothing, so there is no prefix cache to salt.
UNSALTED = {"/tokenize"}


class _RecordingEngine(FakeUpstream):
    """A fake engine that answers every API above and keeps what it was sent, by path."""

    def app(self) -> web.Application:
        app = super().app()
        for path in BODIES:
            if path != "/v1/chat/completions":
                app.router.add_post(path, self._any)
        return app

    async def _any(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append({"path": request.path, **body})
        if request.path == "/v1/responses":
            usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
            return web.json_response(
                {"id": body.get("request_id"), "object": "response", "output": [], "usage": usage}
            )
        if request.path == "/v1/messages":
            usage = {"input_tokens": 3, "output_tokens": 1}
            return web.json_response(
                {"id": "msg_1", "type": "message", "content": [], "usage": usage}
            )
        return web.json_response({"data": [], "usage": {"prompt_tokens": 3, "total_tokens": 3}})


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@asynccontextmanager
async def _gateway(tmp_path: Path, engine: _RecordingEngine) -> AsyncIterator[str]:
    async with serve(engine.app()) as engine_url:
        policy = tmp_path / "policy.yaml"
        policy.write_text(
            f"""
version: 1
replica_pools:
  - {{name: pool-a, replicas: [{engine_url}]}}
models:
  - {{name: base-model, pools: [pool-a]}}
flow_control:
  engine_priority: true
tenants:
  - {{name: gold, api_key_sha256: [{_sha("gold")}], priority: critical}}
  - {{name: bulk, api_key_sha256: [{_sha("bulk")}], priority: sheddable}}
"""
        )
        config = GatewayConfig(policy_path=str(policy), health_interval_s=3600)
        async with serve(create_app(config)) as url:
            yield url


async def test_no_api_lets_a_tenant_set_its_engine_priority_or_borrow_a_cache_salt(
    tmp_path: Path,
) -> None:
    engine = _RecordingEngine()
    gold_salt = derive_cache_salt("gold")
    async with _gateway(tmp_path, engine) as url, aiohttp.ClientSession() as http:
        for path, extra in BODIES.items():
            # The sheddable tenant asks for the front of the engine's queue and gold's salt.
            body = {"model": "base-model", "priority": -100, "cache_salt": gold_salt, **extra,
                    # ... and to steer the engine's KV connector (disaggregated prefill).
                    "kv_transfer_params": {"remote_host": "10.0.0.9", "remote_block_ids": [1]}}
            async with http.post(
                url + path, json=body, headers={"Authorization": "Bearer bulk"}
            ) as resp:
                assert resp.status == 200, (path, await resp.text())
    sent = {b.get("path", "/v1/chat/completions"): b for b in engine.received}
    assert set(sent) == set(BODIES)
    for path, body in sent.items():
        assert body.get("priority") in (None, 1), path  # the sheddable class's, or none
        assert body.get("cache_salt") in (None, derive_cache_salt("bulk")), path
        assert "kv_transfer_params" not in body, path
    assert sent["/v1/chat/completions"]["priority"] == 1
    # Every API that reaches the prefix cache is salted as the tenant (vLLM prefix-caches
    # decoder pooling models too: an unsalted rerank would share another tenant's blocks).
    for path in set(BODIES) - UNSALTED:
        assert sent[path]["cache_salt"] == derive_cache_salt("bulk"), path


@dataclass
class _ResponsesEngine(FakeUpstream):
    """Streams a Responses answer whose connection ends a while after ``response.completed``
    (as the chunked body's end can); ``drop``: closes the connection without answering."""

    drop: bool = False
    #: Stream reasoning deltas instead of text (a reasoning model's first output).
    reasoning: bool = False
    linger_s: float = 2.0

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/responses", self._respond)
        return app

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        self.attempts += 1
        if self.drop:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        response_id = (await request.json())["request_id"]
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for kind, extra in (
            ("response.created", {"response": {"id": response_id, "status": "in_progress"}}),
            (
                "response.reasoning_text.delta" if self.reasoning else "response.output_text.delta",
                {"delta": "hi", "item_id": "m"},
            ),
            (
                "response.completed",
                {
                    "response": {
                        "id": response_id,
                        "status": "completed",
                        "usage": {"input_tokens": 3, "output_tokens": 1},
                    }
                },
            ),
        ):
            data = json.dumps({"type": kind, **extra})
            await out.write(f"event: {kind}\ndata: {data}\n\n".encode())
        await asyncio.sleep(self.linger_s)  # the client has what it needs and may leave
        return out


async def test_a_response_a_fallback_served_is_remembered_where_it_is_stored() -> None:
    failing, serving = _ResponsesEngine(drop=True), _ResponsesEngine()
    async with serve(failing.app()) as url_a, serve(serving.app()) as url_b:
        replicas = [
            ReplicaSpec("r0", url_a, models=frozenset({"base-model"})),
            ReplicaSpec("r1", url_b, models=frozenset({"base-model"})),
        ]
        app = create_app(
            GatewayConfig(health_interval_s=3600),
            GatewayPolicy.default(replicas, profile="round-robin"),
        )
        async with serve(app) as url, aiohttp.ClientSession() as http:
            homes = []
            while failing.attempts < 1 or len(homes) < 2:
                body = {"model": "base-model", "input": "x", "stream": True}
                async with http.post(f"{url}/v1/responses", json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            event = json.loads(line[5:])
                            if event["type"] == "response.completed":
                                response_id = event["response"]["id"]
                                break  # the client has its answer: it hangs up here
                home = await app[GATEWAY].response_affinity.home_of(response_id)
                homes.append(home.replica if home is not None else None)
    assert failing.attempts >= 1  # r0 was tried (round-robin) and failed over to r1
    assert set(homes) == {"r1"}


async def test_a_reasoning_delta_is_the_first_token_of_a_responses_stream() -> None:
    """Routing reads how many requests still await their prefill on a replica, and calibration
    reads TTFTs: a reasoning model's first output is a reasoning delta, not text."""
    engine = _ResponsesEngine(reasoning=True, linger_s=0.0)
    async with serve(engine.app()) as engine_url:
        replicas = [ReplicaSpec("r0", engine_url, models=frozenset({"base-model"}))]
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default(replicas))
        async with serve(app) as url, aiohttp.ClientSession() as http:
            body = {"model": "base-model", "input": "x", "stream": True}
            async with http.post(f"{url}/v1/responses", json=body) as resp:
                await resp.read()
            async with http.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("fleetgate_ttft_seconds_count")
    ]
    assert sum(counts) == 1
