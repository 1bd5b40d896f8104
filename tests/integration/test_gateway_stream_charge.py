"""What a stream that ends before its usage chunk is charged to the tenant's token budget, on
real sockets: the output events the gateway relayed, counted one by one even when a read
brings many at once (a gateway that reads less often than the engine writes), whether the
client hung up or the replica failed mid-stream. Before, a hang-up was charged one token per
read (103 of 300 tokens relayed in the review that found it) and a broken stream nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import GATEWAY
from routing.flow_control import TokenBudgets
from tests.integration.test_gateway_support import engine_app, serve
from tests.support.polling import wait_until

MODEL = "base-model"
BURST = 40  # token events the replica writes at once, after the first


def _chunk(text: str) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _replica(then: str, hold: asyncio.Event) -> web.Application:
    """Streams one token, then ``BURST`` tokens in a single write, then either waits for
    ``hold`` (the client is to hang up) or breaks its connection (``then == "die"``)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("first"))
        await asyncio.sleep(0.05)  # a read of its own for the first token
        await resp.write(b"".join(_chunk(f" t{i}") for i in range(BURST)))
        if then == "die":
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()  # no [DONE], no usage: the engine went away
            return resp
        await hold.wait()
        return resp

    return engine_app(MODEL, {"/v1/chat/completions": chat})


@asynccontextmanager
async def _gateway(tmp_path: Path, then: str) -> AsyncIterator[tuple[str, object, str]]:
    hold = asyncio.Event()
    async with serve(_replica(then, hold)) as replica_url:
        policy = tmp_path / "policy.yaml"
        key_hash = hashlib.sha256(b"metered").hexdigest()
        policy.write_text(f"""
version: 1
replica_pools:
  - name: pool-a
    replicas: [{replica_url}]
models:
  - name: {MODEL}
    pools: [pool-a]
tenants:
  - name: metered
    api_key_sha256: [{key_hash}]
    token_budget: {{completion_tokens_per_minute: 100000}}
""")
        app = create_app(GatewayConfig(policy_path=str(policy), health_interval_s=3600))
        async with serve(app, handler_cancellation=True) as url:
            flow = app[GATEWAY].flow
            minute = 120.0  # a frozen window: one minute turning mid-test would start afresh
            flow.budgets = TokenBudgets(flow.budget_store, lambda: minute, "fleetgate:")
            try:
                yield url, app, f"fleetgate:budget:metered:completion:{int(minute // 60)}"
            finally:
                hold.set()


async def _charged(app: object, key: str) -> int:
    return await app[GATEWAY].flow.budget_store.used(key)  # type: ignore[index]


async def _itl_samples(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith("fleetgate_itl_seconds_count{")
    )


def _body() -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize("then", ["hang_up", "die"])
async def test_a_stream_that_ends_before_its_usage_is_charged_every_token_relayed(
    tmp_path: Path, then: str
) -> None:
    async with _gateway(tmp_path, then) as (url, app, key), aiohttp.ClientSession() as http:
        tokens = 0
        async with http.post(
            f"{url}/v1/chat/completions", json=_body(),
            headers={"Authorization": "Bearer metered"},
        ) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"content"' in line:
                    tokens += 1
                if then == "hang_up" and tokens == 1 + BURST:
                    break  # leaves with the stream open: the connection closes under it
        assert tokens == 1 + BURST
        await wait_until(
            lambda: _positive(_charged(app, key)), "the stream's tokens are charged"
        )
        assert await _charged(app, key) >= 1 + BURST
        # One inter-token gap per token after the first, not one per read.
        await wait_until(
            lambda: _at_least(_itl_samples(url), BURST), "the gaps are observed per token"
        )


async def _positive(value: object) -> bool:
    return await value > 0  # type: ignore[operator]


async def _at_least(value: object, least: float) -> bool:
    return await value >= least  # type: ignore[operator]
