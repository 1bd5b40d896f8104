"""The simulated replica's Responses, Anthropic Messages, embeddings and (de)tokenize endpoints,
driven by the official ``openai`` and ``anthropic`` clients on real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import pytest

from replica.sim.fleet import SimFleet, start_sim_fleet

MODEL = "sim-model"
INSTRUCTIONS = "You answer questions about the fleet router. " * 8


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with start_sim_fleet(2, profile="tiny", speed=1000, kv_events=None) as running:
        yield running


@pytest.fixture
async def clients(fleet: SimFleet) -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """One client per replica."""
    made = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="sim", max_retries=0)
        for url in fleet.urls
    ]
    yield made
    for client in made:
        await client.close()


async def test_responses_create_and_follow_up_on_the_same_replica_only(
    clients: list[openai.AsyncOpenAI],
) -> None:
    here, elsewhere = clients
    first = await here.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input="what is a prefix?", max_output_tokens=4
    )
    assert first.id.startswith("resp_")
    assert first.object == "response"
    assert first.status == "incomplete"  # the sim generates to max tokens, as vLLM reports it
    assert first.output_text.strip()
    assert first.usage is not None and first.usage.output_tokens == 4
    assert first.usage.input_tokens_details.cached_tokens == 0

    follow = await here.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input="and a block?",
        previous_response_id=first.id, max_output_tokens=4,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage is not None
    # The follow-up's prompt is the instructions (they do not carry over: sent again), the first
    # turn, its answer and the new input: longer than the first, and its head is cached.
    assert follow.usage.input_tokens > first.usage.input_tokens + 4
    assert follow.usage.input_tokens_details.cached_tokens > 0
    fetched = await here.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text

    with pytest.raises(openai.NotFoundError) as missing:
        await elsewhere.responses.create(
            model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2
        )
    assert missing.value.status_code == 404
    assert f"Response with id '{first.id}' not found." in str(missing.value)
    with pytest.raises(openai.NotFoundError):
        await elsewhere.responses.retrieve(first.id)


async def test_responses_stream_events_in_vllm_order(clients: list[openai.AsyncOpenAI]) -> None:
    stream = await clients[0].responses.create(
        model=MODEL, input="stream please", max_output_tokens=5, stream=True
    )
    types = []
    deltas = []
    completed = None
    async for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            completed = event.response
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert completed is not None and completed.output_text == "".join(deltas)
    assert completed.usage is not None and completed.usage.output_tokens == 5
    # A streamed response is stored too.
    assert (await clients[0].responses.retrieve(completed.id)).id == completed.id


async def test_anthropic_messages_with_system_stream_and_not(fleet: SimFleet) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=fleet.urls[0], api_key="sim", max_retries=0
    ) as client:
        message = await client.messages.create(
            model=MODEL, system=INSTRUCTIONS, max_tokens=4,
            messages=[{"role": "user", "content": "hello"}],
        )
        assert message.type == "message" and message.role == "assistant"
        assert message.stop_reason == "max_tokens"
        assert message.content[0].type == "text" and message.content[0].text.strip()
        assert message.usage.output_tokens == 4
        assert message.usage.cache_read_input_tokens == 0

        async with client.messages.stream(
            model=MODEL, system=INSTRUCTIONS, max_tokens=4,
            messages=[{"role": "user", "content": "hello"}],
        ) as stream:
            text = "".join([chunk async for chunk in stream.text_stream])
            final = await stream.get_final_message()
        assert text == final.content[0].text
        assert final.usage.output_tokens == 4
        # Same system prompt again: vLLM's input_tokens excludes the cache-read tokens.
        assert final.usage.cache_read_input_tokens is not None
        assert final.usage.cache_read_input_tokens > 0
        assert final.usage.input_tokens == message.usage.input_tokens - \
            final.usage.cache_read_input_tokens

        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model=MODEL, max_tokens=0, messages=[
                {"role": "user", "content": "x"}])
        body = bad.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert "max_tokens" in body["error"]["message"]


async def test_embeddings_deterministic_float_and_base64(clients: list[openai.AsyncOpenAI]) -> None:
    # The SDK asks for base64 by default and decodes it.
    first = await clients[0].embeddings.create(model=MODEL, input=["alpha beta", "gamma"])
    again = await clients[1].embeddings.create(
        model=MODEL, input="alpha beta", encoding_format="float"
    )
    assert [d.index for d in first.data] == [0, 1]
    assert len(first.data[0].embedding) == 64
    assert first.data[0].embedding == pytest.approx(again.data[0].embedding, abs=1e-6)
    assert first.data[0].embedding != pytest.approx(first.data[1].embedding, abs=1e-3)
    assert sum(v * v for v in first.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    assert first.usage.prompt_tokens == first.usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError):
        await clients[0].embeddings.create(model=MODEL, input=[])


async def test_tokenize_then_detokenize(fleet: SimFleet) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{fleet.urls[0]}/tokenize", json={"model": MODEL, "prompt": " the model cache"}
        ) as resp:
            tokens = (await resp.json())["tokens"]
        async with http.post(
            f"{fleet.urls[0]}/detokenize", json={"model": MODEL, "tokens": tokens[1:]}
        ) as resp:
            assert resp.status == 200
            assert (await resp.json()) == {"prompt": " the model cache"}
        async with http.post(
            f"{fleet.urls[0]}/detokenize", json={"model": MODEL, "tokens": ["x"]}
        ) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "tokens"
