"""A Responses stream whose replica dies after it started: the client gets the gateway's
in-band error as the Responses API streams errors (an ``error`` event with type, code, message
and the sequence number after the last event's), which the ``openai`` client hands over as a
``ResponseErrorEvent``."""

from __future__ import annotations

import json

import openai
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from tests.integration.test_gateway_support import engine_app, serve

MODEL = "base-model"


def _event(payload: dict[str, object]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


def dying_replica() -> web.Application:
    """Answers /v1/responses with the stream's first events, then drops the connection."""

    async def responses(request: web.Request) -> web.StreamResponse:
        response_id = (await request.json())["request_id"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = {"id": response_id, "object": "response", "status": "in_progress"}
        await resp.write(
            _event({"type": "response.created", "response": created, "sequence_number": 0})
        )
        # The model's own text naming a sequence number is not the event's.
        text = 'a "sequence_number": 99'
        await resp.write(_event({"type": "response.output_text.delta", "delta": text,
                                 "item_id": "m", "sequence_number": 1}))
        assert request.transport is not None
        request.transport.close()  # the engine dies mid-answer
        return resp

    return engine_app(MODEL, {"/v1/responses": responses})


async def test_mid_stream_failure_reaches_the_openai_client_as_a_responses_error_event() -> None:
    async with serve(dying_replica()) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app, handler_cancellation=True) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            events = [event async for event in stream]
            await client.close()
    assert [e.type for e in events] == [
        "response.created",
        "response.output_text.delta",
        "error",
    ]
    assert events[-1].code == "upstream_error"
    assert "upstream failed mid-stream" in events[-1].message
    assert [e.sequence_number for e in events] == [0, 1, 2]  # the error is numbered last
