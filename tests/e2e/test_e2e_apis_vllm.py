"""The Responses and Anthropic Messages APIs, tokenize and detokenize, through the gateway on the
session's two REAL vLLM CPU engines, with the official ``openai`` and ``anthropic`` clients.

The engines run with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``tests/e2e/conftest.py``): each keeps
its own answers, so a ``previous_response_id`` works only on the engine that made it; the test
shows that on the engines themselves, then that the gateway pins follow-ups there.

Not covered here: embeddings. The tiny model is served as a generative model, and vLLM serves
``/v1/embeddings`` only from a pooling model (``--runner pooling``), which would be a third engine
on this 2-core machine; the integration tier covers embeddings against the simulated replicas.
"""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from replica.launcher import VllmEngine
from replica.tiny_model import TinyModel
from tests.e2e.e2e_support import SERVED_MODEL, Stack, api_key, gateway_stack

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

INSTRUCTIONS = " ".join(f"Rule {i}: answer briefly about the fleet." for i in range(30))


def rid(tag: str) -> str:
    return f"e2e-api-{tag}-{time.time_ns()}"


@pytest.fixture
async def stack(
    redis_url: str, vllm_engines: list[VllmEngine], tiny_model: TinyModel, tmp_path: Path
):  # type: ignore[no-untyped-def]
    async with gateway_stack(redis_url, vllm_engines, tiny_model, tmp_path) as s:
        yield s


async def test_vllm_keeps_a_stored_response_on_the_engine_that_made_it(
    vllm_engines: list[VllmEngine],
) -> None:
    """The premise of the gateway's affinity, on the engines themselves (no gateway)."""
    made, other = (
        openai.AsyncOpenAI(base_url=f"{e.url}/v1", api_key="x", max_retries=0, timeout=120)
        for e in vllm_engines
    )
    try:
        first = await made.responses.create(
            model=SERVED_MODEL, input="hello", max_output_tokens=2, temperature=0
        )
        follow = await made.responses.create(
            model=SERVED_MODEL, input="again", previous_response_id=first.id,
            max_output_tokens=2, temperature=0,
        )
        assert follow.previous_response_id == first.id
        with pytest.raises(openai.NotFoundError):
            await other.responses.create(
                model=SERVED_MODEL, input="again", previous_response_id=first.id,
                max_output_tokens=2,
            )
    finally:
        await made.close()
        await other.close()


async def test_responses_through_the_gateway_follow_ups_pinned(stack: Stack) -> None:
    client = stack.client("alpha")
    first_rid = rid("resp")
    first = await client.responses.create(
        model=SERVED_MODEL, instructions=INSTRUCTIONS, input="What is a prefix cache?",
        max_output_tokens=3, temperature=0, extra_headers={"X-Request-Id": first_rid},
    )
    assert first.id.startswith("resp_")
    assert first.usage is not None and first.usage.output_tokens > 0
    previous, follow_rids = first.id, []
    for turn in range(3):
        follow_rids.append(rid(f"follow{turn}"))
        # No instructions: the prompt shares no prefix with anything the index knows, so only
        # the affinity can pick the engine that holds the conversation.
        follow = await client.responses.create(
            model=SERVED_MODEL, input=f"and then {turn}?", previous_response_id=previous,
            max_output_tokens=2, temperature=0, extra_headers={"X-Request-Id": follow_rids[-1]},
        )
        assert follow.previous_response_id == previous
        previous = follow.id
    assert (await client.responses.retrieve(first.id)).id == first.id

    stream = await client.responses.create(
        model=SERVED_MODEL, input="stream a word", previous_response_id=previous,
        max_output_tokens=3, temperature=0, stream=True,
        extra_headers={"X-Request-Id": rid("stream")},
    )
    events = [event async for event in stream]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage is not None

    log = await stack.decisions()
    home = log[first_rid]["served_by"]
    for follow_rid in follow_rids:
        assert log[follow_rid]["served_by"] == home
        assert log[follow_rid]["profile"] == "pinned"
    # Another tenant cannot continue alpha's conversation (indistinguishable from unknown).
    with pytest.raises(openai.NotFoundError) as foreign:
        await stack.client("beta").responses.create(
            model=SERVED_MODEL, input="x", previous_response_id=first.id, max_output_tokens=1
        )
    assert foreign.value.code == "response_not_found"


async def test_anthropic_messages_through_the_gateway(stack: Stack) -> None:
    prompt_before = await stack.gateway_metric("fleetgate_prompt_tokens_total")
    async with anthropic.AsyncAnthropic(
        base_url=stack.url, api_key=api_key("alpha"), max_retries=0, timeout=120
    ) as claude:
        first_rid, second_rid = rid("msg"), rid("msg")
        message = await claude.messages.create(
            model=SERVED_MODEL, system=INSTRUCTIONS, max_tokens=3, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"X-Request-Id": first_rid},
        )
        assert message.type == "message" and message.usage.output_tokens > 0
        async with claude.messages.stream(
            model=SERVED_MODEL, system=INSTRUCTIONS, max_tokens=3, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"X-Request-Id": second_rid},
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert final.usage.output_tokens > 0
        assert text == "".join(
            block.text for block in final.content if block.type == "text"
        )
        # The same system prompt again: routed to the engine that caches it, and vLLM reports
        # the hit as cache_read_input_tokens (its input_tokens exclude them).
        assert final.usage.cache_read_input_tokens is not None
        assert final.usage.cache_read_input_tokens > 0
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await claude.messages.create(
                model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
        assert unknown.value.body["type"] == "error"  # type: ignore[index]
        assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    log = await stack.decisions()
    assert log[second_rid]["served_by"] == log[first_rid]["served_by"]
    assert log[second_rid]["cached_tokens"] == final.usage.cache_read_input_tokens
    # The gateway counted each whole prompt: vLLM's input_tokens exclude both the cache reads
    # and the tokens written to the cache (cache_creation_input_tokens).
    prompts = sum(
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        for u in (message.usage, final.usage)
    )
    after = await stack.gateway_metric("fleetgate_prompt_tokens_total")
    assert after - prompt_before == prompts


async def test_tokenize_and_detokenize_through_the_gateway(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {api_key('alpha')}"}
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(f"{stack.url}/tokenize", headers=headers,
                               json={"model": SERVED_MODEL, "prompt": "the fleet router"})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["count"] == len(body["tokens"]) > 0
        resp = await http.post(f"{stack.url}/detokenize", headers=headers,
                               json={"model": SERVED_MODEL, "tokens": body["tokens"]})
        assert resp.status_code == 200, resp.text
        assert "the fleet router" in resp.json()["prompt"]
