"""Every vLLM API through the embedded stack (``fleetgate up``: gateway + two simulated replicas),
driven by the official ``openai`` and ``anthropic`` clients.

Responses (stream and not; ``previous_response_id`` follow-ups landing on the replica that
stored the previous response, checked in the gateway's decision log), Anthropic Messages (stream
and not, errors in Anthropic's envelope), embeddings, tokenize/detokenize, and the errors of a
follow-up the gateway cannot serve (unknown id, replica gone).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from fleetgate.embedded import EmbeddedStack, embedded_stack
from gateway.response_affinity import ResponseHome
from gateway.state import GATEWAY
from routing.types import ReplicaId

ADMIN_KEY = "apis-admin"
INSTRUCTIONS = " ".join(f"Support policy clause {i} of the fleet router." for i in range(40))


@pytest.fixture
async def stack() -> AsyncIterator[EmbeddedStack]:
    async with embedded_stack(2, sim_speed=200.0, admin_key=ADMIN_KEY) as running:
        yield running


@pytest.fixture
async def client(stack: EmbeddedStack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="any", max_retries=0
    ) as oai:
        yield oai


async def _decisions(stack: EmbeddedStack) -> dict[str, dict[str, Any]]:
    """The gateway's decision log, by request id."""
    async with aiohttp.ClientSession() as http, http.get(
        f"{stack.url}/admin/decisions?n=200", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ) as resp:
        assert resp.status == 200, await resp.text()
        return {d["request_id"]: d for d in (await resp.json())["decisions"]}


async def _metrics(stack: EmbeddedStack) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{stack.url}/metrics") as resp:
        return await resp.text()


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_responses_follow_ups_land_on_the_replica_that_stored_them(
    stack: EmbeddedStack, client: openai.AsyncOpenAI
) -> None:
    first = await client.responses.create(
        model=stack.model, instructions=INSTRUCTIONS, input="What is a prefix?",
        max_output_tokens=4, extra_headers={"X-Request-Id": "turn-0"},
    )
    assert first.id.startswith("resp_") and first.output_text.strip()
    previous = first.id
    # A chain of follow-ups: each one's previous response lives only on the replica that made
    # it (any other answers 404), so every turn must be pinned there.
    for turn in range(1, 4):
        follow = await client.responses.create(
            model=stack.model, instructions=INSTRUCTIONS, input=f"Follow-up {turn}?",
            previous_response_id=previous, max_output_tokens=4,
            extra_headers={"X-Request-Id": f"turn-{turn}"},
        )
        assert follow.previous_response_id == previous
        previous = follow.id
    fetched = await client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text

    log = await _decisions(stack)
    home = log["turn-0"]["served_by"]
    assert home in ("sim/0", "sim/1")
    for turn in range(1, 4):
        assert log[f"turn-{turn}"]["served_by"] == home
        assert log[f"turn-{turn}"]["profile"] == "pinned"
        assert log[f"turn-{turn}"]["status"] == 200
        # The index was not asked: no prediction to check against the engine's cached tokens.
        assert "predicted_cached_tokens" not in log[f"turn-{turn}"]
        assert log[f"turn-{turn}"]["blocks"] == 0  # no blocks of its own to match or write
    assert "predicted_cached_tokens" in log["turn-0"]
    # Accounted like chat: the responses' usage reached the token counters.
    metrics = await _metrics(stack)
    assert _metric(metrics, "fleetgate_completion_tokens_total") == 4 * 4
    assert _metric(metrics, "fleetgate_cached_tokens_total") > 0


async def test_follow_ups_whose_prompt_shares_nothing_are_still_pinned(
    stack: EmbeddedStack, client: openai.AsyncOpenAI
) -> None:
    # Follow-ups without the instructions share no prompt block with anything: the policy alone
    # would spread them over both replicas (idle, tied), and half would hit the replica that
    # does not hold the conversation (a 404 from the engine). Pinned, all of them succeed.
    homes = {}
    for c in range(6):
        started = await client.responses.create(
            model=stack.model, input=f"Conversation {c}: " + INSTRUCTIONS, max_output_tokens=2,
            extra_headers={"X-Request-Id": f"conv-{c}"},
        )
        follow = await client.responses.create(
            model=stack.model, input="ok?", previous_response_id=started.id,
            max_output_tokens=2, extra_headers={"X-Request-Id": f"conv-{c}-next"},
        )
        assert follow.previous_response_id == started.id
        homes[c] = started.id
    log = await _decisions(stack)
    assert {log[f"conv-{c}"]["served_by"] for c in homes} <= {"sim/0", "sim/1"}
    for c in homes:
        assert log[f"conv-{c}-next"]["served_by"] == log[f"conv-{c}"]["served_by"]


async def test_responses_stream_through_the_gateway(
    stack: EmbeddedStack, client: openai.AsyncOpenAI
) -> None:
    stream = await client.responses.create(
        model=stack.model, instructions=INSTRUCTIONS, input="stream it", max_output_tokens=5,
        stream=True, extra_headers={"X-Request-Id": "streamed"},
    )
    events = [event async for event in stream]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    completed = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert completed.output_text == deltas and deltas.strip()
    # The streamed response was recorded too: its follow-up lands on the same replica.
    follow = await client.responses.create(
        model=stack.model, input="next", previous_response_id=completed.id,
        max_output_tokens=2, extra_headers={"X-Request-Id": "after-stream"},
    )
    assert follow.status in ("completed", "incomplete")
    log = await _decisions(stack)
    assert log["after-stream"]["served_by"] == log["streamed"]["served_by"]
    # TTFT ends at the first output_text.delta (the marker was seen), not at response.created.
    assert log["streamed"]["ttft_ms"] is not None
    # The usage sits inside response.completed: the gateway still counted the output tokens.
    metrics = await _metrics(stack)
    assert _metric(metrics, "fleetgate_completion_tokens_total") == 5 + 2


async def test_follow_ups_the_gateway_cannot_serve(
    stack: EmbeddedStack, client: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.responses.create(
            model=stack.model, input="x", previous_response_id="resp_never", max_output_tokens=2
        )
    assert unknown.value.code == "response_not_found"
    assert "resp_never" in unknown.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_never")

    # A response stored by a replica that has since left the fleet: a 404 that says so.
    gw = stack.app[GATEWAY]
    await gw.response_affinity.remember("resp_orphan", ResponseHome(ReplicaId("sim/9"), "default"))
    with pytest.raises(openai.NotFoundError) as gone:
        await client.responses.create(
            model=stack.model, input="x", previous_response_id="resp_orphan", max_output_tokens=2
        )
    assert gone.value.code == "response_replica_gone"
    assert "sim/9" in gone.value.message and "left the fleet" in gone.value.message

    # Another tenant's response is indistinguishable from an unknown one.
    first = await client.responses.create(model=stack.model, input="mine", max_output_tokens=2)
    # DELETE goes to its replica too; vLLM (and the sim) cannot delete: their 405 is relayed.
    with pytest.raises(openai.APIStatusError) as undeletable:
        await client.responses.delete(first.id)
    assert undeletable.value.status_code == 405
    home = await gw.response_affinity.home_of(first.id)
    assert home is not None
    await gw.response_affinity.remember(first.id, ResponseHome(home.replica, "someone-else"))
    with pytest.raises(openai.NotFoundError) as foreign:
        await client.responses.create(
            model=stack.model, input="x", previous_response_id=first.id, max_output_tokens=2
        )
    assert foreign.value.code == "response_not_found"


async def test_anthropic_messages_stream_and_not(stack: EmbeddedStack) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=stack.url, api_key="any", max_retries=0
    ) as claude:
        message = await claude.messages.create(
            model=stack.model, system=INSTRUCTIONS, max_tokens=4,
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"X-Request-Id": "msg-0"},
        )
        assert message.stop_reason == "max_tokens" and message.content[0].text.strip()
        async with claude.messages.stream(
            model=stack.model, system=INSTRUCTIONS, max_tokens=3,
            messages=[{"role": "user", "content": "hello again"}],
            extra_headers={"X-Request-Id": "msg-1"},
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == final.content[0].text and text.strip()
        # The shared system prompt: the second request went where it is cached.
        assert final.usage.cache_read_input_tokens is not None
        assert final.usage.cache_read_input_tokens > 0

        with pytest.raises(anthropic.NotFoundError) as unknown_model:
            await claude.messages.create(
                model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
        assert unknown_model.value.body == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "The model `no-such-model` does not "
                      "exist."},
        }
        assert unknown_model.value.response.headers["X-Fleetgate-Error-Code"] == "model_not_found"
        with pytest.raises(anthropic.BadRequestError) as no_max_tokens:
            await claude.messages.create(
                model=stack.model, max_tokens=0, messages=[{"role": "user", "content": "x"}]
            )
        body = no_max_tokens.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in body["error"]["message"]

    log = await _decisions(stack)
    assert log["msg-1"]["served_by"] == log["msg-0"]["served_by"]
    # Anthropic's input_tokens exclude cache reads; the gateway counts the whole prompt.
    metrics = await _metrics(stack)
    prompt_total = _metric(metrics, "fleetgate_prompt_tokens_total")
    assert prompt_total == log["msg-0"]["prompt_tokens"] + log["msg-1"]["prompt_tokens"]
    assert _metric(metrics, "fleetgate_completion_tokens_total") == 4 + 3


async def test_embeddings_and_tokenize_detokenize(
    stack: EmbeddedStack, client: openai.AsyncOpenAI
) -> None:
    result = await client.embeddings.create(model=stack.model, input=["alpha", "beta gamma"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 64
    assert result.usage.prompt_tokens > 0
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.embeddings.create(model="no-such-model", input="x")
    assert unknown.value.code == "model_not_found"

    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{stack.url}/tokenize", json={"model": stack.model, "prompt": " the model"}
        ) as resp:
            assert resp.status == 200, await resp.text()
            tokens = (await resp.json())["tokens"]
        async with http.post(
            f"{stack.url}/detokenize", json={"model": stack.model, "tokens": tokens[1:]}
        ) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.json() == {"prompt": " the model"}
        async with http.post(f"{stack.url}/tokenize", json={"prompt": "no model"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "model"


async def test_stream_true_on_an_endpoint_that_never_streams_is_relayed_and_charged(
    stack: EmbeddedStack,
) -> None:
    # vLLM ignores "stream" on embeddings: the answer is JSON, and the gateway must relay it as
    # JSON and charge its usage (it used to relay it as an event stream and charge nothing, so a
    # tenant could dodge its token budget with one extra field).
    before = _metric(await _metrics(stack), "fleetgate_prompt_tokens_total")
    async with aiohttp.ClientSession() as http, http.post(
        f"{stack.url}/v1/embeddings",
        json={"model": stack.model, "input": "alpha beta gamma", "stream": True},
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/json"
        answer = await resp.json()
    charged = _metric(await _metrics(stack), "fleetgate_prompt_tokens_total") - before
    assert answer["usage"]["prompt_tokens"] > 0
    assert charged == answer["usage"]["prompt_tokens"]


async def test_count_tokens_pooling_relay_and_unrouted_endpoints(stack: EmbeddedStack) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=stack.url, api_key="any", max_retries=0
    ) as claude:
        counted = await claude.messages.count_tokens(
            model=stack.model, system=INSTRUCTIONS, messages=[{"role": "user", "content": "hi"}]
        )
        sent = await claude.messages.create(
            model=stack.model, system=INSTRUCTIONS, max_tokens=1,
            messages=[{"role": "user", "content": "hi"}],
        )
    # The count is the whole prompt the engine then prefills (input + cache reads).
    assert counted.input_tokens == sent.usage.input_tokens + (
        sent.usage.cache_read_input_tokens or 0
    )
    async with aiohttp.ClientSession() as http:
        # A pooling endpoint is routed to a replica of the model and its answer relayed as it is
        # (the simulated replica, a generative engine, has no /rerank: vLLM's own 404 comes back).
        async with http.post(
            f"{stack.url}/rerank", json={"model": stack.model, "query": "q", "documents": ["d"]},
            headers={"X-Request-Id": "rerank-1"},
        ) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["message"] == "Not Found: /rerank"
        async with http.post(
            f"{stack.url}/v1/audio/transcriptions", data=b"audio bytes"
        ) as resp:
            assert resp.status == 501
            error = (await resp.json())["error"]
            assert error["code"] == "not_routed"
            assert "/v1/audio/transcriptions" in error["message"]
        async with http.post(f"{stack.url}/v1/load_lora_adapter", json={}) as resp:
            assert resp.status == 404  # engine control is not exposed to tenants
    rerank = (await _decisions(stack))["rerank-1"]
    assert rerank["served_by"] in ("sim/0", "sim/1") and rerank["status"] == 404


async def test_request_forms_vllm_takes_are_routed_not_refused(stack: EmbeddedStack) -> None:
    """Forms vLLM accepts that the gateway once refused with its own 400: chat-style embeddings,
    completions from ``prompt_embeds`` alone, plain-string and null-text content parts, and
    vLLM's render endpoints. Each must reach a replica (the simulated one answers what it can:
    a generative sim has no render endpoints and no chat embeddings, so its own error comes
    back, which shows the request was routed)."""
    async with aiohttp.ClientSession() as http:

        async def post(path: str, body: dict[str, Any], rid: str) -> tuple[int, dict[str, Any]]:
            async with http.post(
                f"{stack.url}{path}", json=body, headers={"X-Request-Id": rid}
            ) as resp:
                return resp.status, await resp.json()

        user = {"role": "user", "content": "embed me"}
        forms = {
            "emb-messages": ("/v1/embeddings", {"model": stack.model, "messages": [user]}),
            "emb-chat-input": ("/v1/embeddings", {"model": stack.model, "input": [user]}),
            "embeds-only": ("/v1/completions", {"model": stack.model, "prompt_embeds": "AAAA",
                                                "max_tokens": 1}),
            "render-chat": ("/v1/chat/completions/render", {"model": stack.model,
                                                            "messages": [user]}),
            "render-responses": ("/v1/responses/render", {"model": stack.model, "input": "x"}),
        }
        for rid, (path, body) in forms.items():
            await post(path, body, rid)  # routed: in the decision log below, served by a replica
        parts = [{"type": "text", "text": None}, "Where does", {"type": "input_text",
                                                                 "text": "the fox nap?"}]
        status, answer = await post(
            "/v1/chat/completions",
            {"model": stack.model, "max_tokens": 2, "messages": [{"role": "user",
                                                                  "content": parts}]},
            "string-parts",
        )
        assert status == 200, answer
        status, answer = await post(
            "/v1/chat/completions",
            {"model": stack.model, "messages": [user], "tools": "not a list"},
            "bad-tools",
        )
        assert status == 400 and answer["error"]["param"] == "tools", answer
        for method, path in (("POST", "/invocations"), ("GET", "/tokenizer_info")):
            async with http.request(method, f"{stack.url}{path}") as resp:
                assert resp.status == 501 and (await resp.json())["error"]["code"] == "not_routed"
        for method in ("GET", "POST"):
            async with http.request(method, f"{stack.url}/ping") as resp:
                assert resp.status == 200
    decisions = await _decisions(stack)
    for rid in (*forms, "string-parts"):
        assert decisions[rid]["served_by"] in ("sim/0", "sim/1"), (rid, decisions.get(rid))
