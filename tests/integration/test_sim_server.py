"""The simulated replica's HTTP API, driven by the official ``openai`` client on real sockets."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from replica.sim.fleet import SimFleet, start_sim_fleet

PROMPT = "the shared system prompt of a retrieval chatbot " * 12


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with start_sim_fleet(1, profile="tiny", speed=1000, kv_events=None) as running:
        yield running


@pytest.fixture
async def client(fleet: SimFleet) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=fleet.urls[0] + "/v1", api_key="sim", max_retries=0
    ) as oai:
        yield oai


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_completion_reports_cached_tokens_on_repeat(
    fleet: SimFleet, client: openai.AsyncOpenAI
) -> None:
    first = await client.completions.create(model="sim-model", prompt=PROMPT, max_tokens=3)
    second = await client.completions.create(model="sim-model", prompt=PROMPT, max_tokens=3)
    assert first.object == "text_completion"
    assert first.id.startswith("cmpl-")
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].text.strip()
    assert first.usage is not None and second.usage is not None
    assert first.usage.completion_tokens == 3
    assert first.usage.total_tokens == first.usage.prompt_tokens + 3
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Every full block but the one holding the last prompt token is served from the cache.
    block_size = fleet.replicas[0].replica.engine_config.block_size
    expected = (second.usage.prompt_tokens - 1) // block_size * block_size
    assert expected > 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    # Same prompt, same (deterministic) answer.
    assert second.choices[0].text == first.choices[0].text


async def test_streaming_completion(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model="sim-model", prompt=PROMPT, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks).strip()
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == 4


async def test_chat_non_streaming_and_streaming_agree(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hello"}]
    full = await client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=5  # type: ignore[arg-type]
    )
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage is not None and full.usage.completion_tokens == 5

    stream = await client.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=5, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage is not None
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens > 0  # the non-streaming call cached the same prompt


async def test_stream_without_usage_ends_with_done(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    async with http.post(fleet.urls[0] + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [line for line in raw.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert '"usage"' not in raw


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["type"] == "NotFoundError"
    assert error["code"] == 404
    assert error["param"] == "model"
    assert "no-such-model" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "sim-model", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "sim-model", "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
        ({"model": "sim-model", "prompt": {"not": "a prompt"}}, "prompt"),
        ({"model": "sim-model", "prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ],
)
async def test_bad_requests_are_400_in_vllm_envelope(
    fleet: SimFleet, http: aiohttp.ClientSession, body: dict[str, object], param: str
) -> None:
    async with http.post(fleet.urls[0] + "/v1/completions", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert error["param"] == param


async def test_models_and_adapter_lifecycle(
    fleet: SimFleet, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    base = fleet.urls[0]
    load = {"lora_name": "tenant-a-ft", "lora_path": "/adapters/tenant-a-ft"}
    async with http.post(base + "/v1/load_lora_adapter", json=load) as resp:
        assert resp.status == 200
        assert await resp.text() == "Success: LoRA adapter 'tenant-a-ft' added successfully."
    async with http.post(base + "/v1/load_lora_adapter", json=load) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "InvalidUserInput"

    models = (await client.models.list()).data
    assert [m.id for m in models] == ["sim-model", "tenant-a-ft"]
    adapter_card = models[1].model_dump()
    assert adapter_card["parent"] == "sim-model"
    assert adapter_card["root"] == "/adapters/tenant-a-ft"
    assert models[0].model_dump()["parent"] is None

    done = await client.completions.create(model="tenant-a-ft", prompt=PROMPT, max_tokens=2)
    assert done.model == "tenant-a-ft"

    unload = {"lora_name": "tenant-a-ft"}
    async with http.post(base + "/v1/unload_lora_adapter", json=unload) as resp:
        assert resp.status == 200
        assert await resp.text() == "Success: LoRA adapter 'tenant-a-ft' removed successfully."
    async with http.post(base + "/v1/unload_lora_adapter", json=unload) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="tenant-a-ft", prompt="hi", max_tokens=1)


async def test_load_adapter_validation(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    base = fleet.urls[0]
    for body in ({"lora_name": "x"}, {"lora_name": "sim-model", "lora_path": "/p"}):
        async with http.post(base + "/v1/load_lora_adapter", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == 400


async def test_tokenize_prompt_and_messages(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0] + "/tokenize"
    async with http.post(url, json={"model": "sim-model", "prompt": PROMPT}) as resp:
        first = await resp.json()
    async with http.post(url, json={"prompt": PROMPT + " and more"}) as resp:
        longer = await resp.json()
    assert first["count"] == len(first["tokens"]) > 0
    assert first["max_model_len"] == fleet.replicas[0].replica.max_model_len
    # Deterministic, and a longer text shares the shorter one's tokens as a prefix.
    assert longer["tokens"][: first["count"]] == first["tokens"]
    messages = [{"role": "user", "content": PROMPT}]
    async with http.post(url, json={"messages": messages}) as resp:
        chat = await resp.json()
    assert chat["count"] > first["count"]  # the template adds role markers


async def test_overloaded_replica_answers_503() -> None:
    async with (
        start_sim_fleet(1, profile="tiny", speed=1000, kv_events=None, max_waiting=0) as fleet,
        openai.AsyncOpenAI(base_url=fleet.urls[0] + "/v1", api_key="s", max_retries=0) as oai,
    ):
        with pytest.raises(openai.APIStatusError) as info:
            await oai.completions.create(model="sim-model", prompt="hi", max_tokens=1)
    assert info.value.status_code == 503
    assert isinstance(info.value.body, dict)
    assert info.value.body["type"] == "ServiceUnavailableError"


async def test_health_and_version(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    async with http.get(fleet.urls[0] + "/health") as resp:
        assert resp.status == 200
    async with http.get(fleet.urls[0] + "/version") as resp:
        assert (await resp.json())["version"].startswith("0.")


def _write_hf_tokenizer(directory: Path) -> None:
    """A tiny byte-level BPE and a chat template, as a model directory would hold them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"])
    tok.train_from_iterator([PROMPT, "hello world, the model answers"] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


async def test_hf_tokenizer_directory_matches_the_gateway_tokenizer(tmp_path: Path) -> None:
    from routing.tokenize import LocalTokenizer

    _write_hf_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hello world"}]
    gateway_side = await LocalTokenizer(tmp_path).tokenize_chat("sim-model", messages)
    async with (
        start_sim_fleet(1, profile="tiny", speed=1000, kv_events=None,
                        tokenizer_dir=str(tmp_path)) as fleet,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(fleet.urls[0] + "/tokenize", json={"messages": messages}) as resp:
            assert resp.status == 200
            assert (await resp.json())["tokens"] == list(gateway_side.token_ids or [])
        body = {"model": "sim-model", "messages": messages, "max_tokens": 3}
        async with http.post(fleet.urls[0] + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
    assert answer["usage"]["prompt_tokens"] == len(gateway_side.token_ids or [])
    assert answer["usage"]["completion_tokens"] == 3



@pytest.mark.parametrize(
    ("path", "opening"),
    [("/v1/chat/completions", "chat.completion.chunk"), ("/v1/messages", "message_start")],
)
async def test_stream_opens_with_the_first_token_not_before_prefill(
    http: aiohttp.ClientSession, path: str, opening: str
) -> None:
    """vLLM writes the chat role chunk (and, converting that stream, Anthropic's message_start)
    with the first token. A gateway reads the first event as the first token (TTFT, prefill
    backlog, prefill-speed calibration), so a sim that sent it before prefill taught the gateway
    a prefill speed many times the real one."""
    async with start_sim_fleet(1, profile="tiny", speed=0.05, kv_events=None) as slow:
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 2,
            "stream": True,
        }
        async with http.post(slow.urls[0] + path, json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")
            # Read the engine's counter the moment the first event arrives: the token that
            # event stands for must already have been generated.
            async with http.get(slow.urls[0] + "/metrics") as page:
                metrics = await page.text()
            rest = await resp.read()
    generated = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    ]
    assert generated and generated[0] >= 1, "the stream opened before any token"
    assert opening in first.decode()
    assert rest.decode().strip()


async def test_a_sampling_field_that_is_no_number_is_a_400(client: openai.AsyncOpenAI) -> None:
    """vLLM's request models type these as numbers; the sim answered 200 (the new user's
    review). A number written as a string passes, as pydantic reads it."""
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(
            model="sim-model", prompt="hi", max_tokens=1, extra_body={"temperature": "hot"}
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:  # an integer field
        await client.completions.create(
            model="sim-model", prompt="hi", max_tokens=1, extra_body={"top_k": 2.5}
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "top_k"
    ok = await client.completions.create(
        model="sim-model", prompt="hi", max_tokens=1, extra_body={"top_p": "0.9"}
    )
    assert ok.choices
