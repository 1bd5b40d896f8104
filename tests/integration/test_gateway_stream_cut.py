"""A stream the replica ends cleanly, as HTTP goes, but before its last event: an ingress's idle
timeout, an engine shutting down gracefully. The body's end looks like a complete answer to the
client unless the gateway checks for the stream's own last event (chat's ``data: [DONE]``, the
Responses API's final state, Anthropic's ``message_stop``); it ends the stream with the API's
in-band error instead, which the official clients raise, and counts it as a 502."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from tests.integration.test_gateway_support import engine_app, serve

MODEL = "base-model"


def _chunk(text: str) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _event(name: str, payload: dict[str, object]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def scripted_replica(
    tail: bytes, finish: bool, first_text: str = "one"
) -> web.Application:
    """Streams two events on every API, then ``tail`` (a half event, or nothing), then the
    stream's own last event only if ``finish``, and ends the body properly."""

    async def stream(request: web.Request, events: list[bytes], last: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        await resp.write(last if finish else tail)
        await resp.write_eof()
        return resp

    async def chat(request: web.Request) -> web.StreamResponse:
        return await stream(request, [_chunk(first_text), _chunk(" two")], b"data: [DONE]\n\n")

    async def responses(request: web.Request) -> web.StreamResponse:
        rid = (await request.json())["request_id"]
        created = {"id": rid, "object": "response", "status": "in_progress", "output": []}
        events = [
            _event("response.created", {"type": "response.created", "response": created,
                                        "sequence_number": 0}),
            _event("response.output_text.delta", {
                "type": "response.output_text.delta", "delta": "one", "item_id": "m",
                "output_index": 0, "content_index": 0, "sequence_number": 1}),
        ]
        done = {**created, "status": "completed"}
        last = _event("response.completed", {"type": "response.completed", "response": done,
                                             "sequence_number": 2})
        return await stream(request, events, last)

    async def messages(request: web.Request) -> web.StreamResponse:
        message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                   "model": MODEL, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 5, "output_tokens": 0}}
        events = [
            _event("message_start", {"type": "message_start", "message": message}),
            _event("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
        ]
        return await stream(request, events, _event("message_stop", {"type": "message_stop"}))

    return engine_app(
        MODEL, {"/v1/chat/completions": chat, "/v1/responses": responses, "/v1/messages": messages}
    )


@asynccontextmanager
async def gateway(
    tail: bytes = b"", finish: bool = False, first_text: str = "one"
) -> AsyncIterator[str]:
    async with serve(scripted_replica(tail, finish, first_text)) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app, handler_cancellation=True) as url:
            yield url


async def _errors_counted(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith("fleetgate_errors_total{") and 'code="upstream_error"' in line
    )


@pytest.mark.parametrize(
    ("tail", "first_text"),
    [
        (b"", "one"),
        (b'data: {"id":"c1","choi', "one"),
        # A model's own text that reads like the last event is inside a JSON string: no end.
        (b"", "data: [DONE]"),
    ],
)
async def test_a_chat_stream_cut_short_cleanly_raises_in_the_openai_client(
    tail: bytes, first_text: str
) -> None:
    async with gateway(tail, first_text=first_text) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        texts = []
        with pytest.raises(openai.APIError, match="upstream failed mid-stream"):
            async for chunk in stream:
                texts.append(chunk.choices[0].delta.content)
        await client.close()
        assert texts == [first_text, " two"]  # the half event never reached the client
        assert await _errors_counted(url) == 1


async def test_a_complete_chat_stream_is_relayed_as_it_is() -> None:
    async with gateway(finish=True) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        texts = [chunk.choices[0].delta.content async for chunk in stream]
        await client.close()
        assert texts == ["one", " two"]
        assert await _errors_counted(url) == 0


@pytest.mark.parametrize(
    ("finish", "last"), [(False, "error"), (True, "response.completed")]
)
async def test_a_responses_stream_ends_with_its_final_event_or_an_error_event(
    finish: bool, last: str
) -> None:
    async with gateway(finish=finish) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        types = [event.type async for event in stream]
        await client.close()
    assert types == ["response.created", "response.output_text.delta", last]


async def test_a_messages_stream_cut_short_raises_in_the_anthropic_client() -> None:
    async with gateway() as url:
        client = anthropic.AsyncAnthropic(base_url=url, api_key="any", max_retries=0)
        with pytest.raises(anthropic.APIStatusError, match="upstream failed mid-stream"):
            async with client.messages.stream(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                async for _ in stream:
                    pass
        await client.close()


async def test_an_error_the_engine_streams_is_relayed_and_counted_as_a_failure() -> None:
    # vLLM ends a chat stream it failed with the error as data, then [DONE]: the client gets
    # the engine's own error, and the request counts as a 502, not as a 200 that met its SLO.
    error = {"message": "EngineCore died", "type": "InternalServerError", "code": 500}
    engine_error = f"data: {json.dumps({'error': error})}\n\n".encode()
    async with gateway(engine_error + b"data: [DONE]\n\n") as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="EngineCore died"):
            async for _ in stream:
                pass
        await client.close()
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    assert any(
        line.startswith("fleetgate_requests_total{") and 'status="502"' in line
        and line.endswith(" 1.0") for line in text.splitlines()
    )


async def test_a_stream_that_ends_before_its_first_event_goes_to_a_fallback() -> None:
    async def empty(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write_eof()
        return resp

    async with (
        serve(engine_app(MODEL, {"/v1/chat/completions": empty})) as empty_url,
        serve(scripted_replica(b"", True)) as well_url,
    ):
        specs = [
            ReplicaSpec("empty", empty_url, models=frozenset({MODEL})),
            ReplicaSpec("well", well_url, models=frozenset({MODEL})),
        ]
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default(specs))
        async with serve(app, handler_cancellation=True) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            for i in range(6):  # routing spreads ties: some go to the empty one first
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], stream=True
                )
                assert [c.choices[0].delta.content async for c in stream] == ["one", " two"]
            await client.close()
