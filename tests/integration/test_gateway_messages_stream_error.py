"""A Messages stream whose replica dies after it started: the client gets the gateway's in-band
error as Anthropic streams errors (``event: error``), which the ``anthropic`` client raises."""

from __future__ import annotations

import json

import anthropic
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from tests.integration.test_gateway_support import engine_app, serve

MODEL = "base-model"


def _event(name: str, payload: dict[str, object]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def dying_replica() -> web.Application:
    """Answers /v1/messages with the stream's first events, then drops the connection."""

    async def messages(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                   "model": MODEL, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 5, "output_tokens": 0}}
        await resp.write(_event("message_start", {"type": "message_start", "message": message}))
        await resp.write(_event("content_block_start", {
            "type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}))
        await resp.write(_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "partial"}}))
        assert request.transport is not None
        request.transport.close()  # the engine dies mid-answer
        return resp

    return engine_app(MODEL, {"/v1/messages": messages})


async def test_mid_stream_failure_reaches_the_anthropic_client_as_an_error_event() -> None:
    async with serve(dying_replica()) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app, handler_cancellation=True) as url, anthropic.AsyncAnthropic(
            base_url=url, api_key="any", max_retries=0
        ) as claude:
            received = []
            with pytest.raises(anthropic.APIStatusError) as failed:
                async with claude.messages.stream(
                    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                ) as stream:
                    async for text in stream.text_stream:
                        received.append(text)
    assert received == ["partial"]
    assert "upstream failed mid-stream" in str(failed.value)
    body = failed.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "api_error"
