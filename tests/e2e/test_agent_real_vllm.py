"""The replica agent on real vLLM CPU engines: events, hashing, metrics and the fleet store.

The central claim: a request to a real engine makes it publish ``BlockStored`` events; the agent
decodes them and writes fleetgate's own chained hashes to a Redis index; and the chain that
fleetgate computes from the *prompt* (its tokenizer + ``routing.hashing``) finds the replica.
If fleetgate's hashing, tokenization or seed folding (adapter, cache_salt) diverged from what the
engine caches, these tests would fail.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import RedisFleetStore
from replica.kv_events import KVEventSubscriber
from replica.launcher import VllmEngine
from replica.tiny_model import TinyModel
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import RedisBlockIndex
from routing.template_inputs import chat_template_variables
from routing.tokenize.local import LocalTokenizer
from tests.e2e.conftest import SERVED_MODEL
from tests.support import polling
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

BLOCK_SIZE = 32
_unique = itertools.count()


#: Real engines are slow to act on: 30 s by default.
wait_until = functools.partial(polling.wait_until, timeout_s=30.0, interval_s=0.02)


def fresh_prompt(words: int = 90) -> str:
    """A prompt no earlier request of this session used (so its blocks are newly stored)."""
    tag = f"request {next(_unique)} at {time.time_ns()} "
    body = " ".join(["the fleet of replicas routes every request to the engine"] * (words // 10))
    return tag + body


class Replica:
    """One real engine with an agent writing to a shared Redis index."""

    def __init__(self, engine: VllmEngine, agent: ReplicaAgent) -> None:
        self.engine = engine
        self.agent = agent
        self.client = openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused")

    async def synced(self) -> None:
        """Send fresh prompts until the agent has applied an event batch from this engine.

        A ZMQ subscriber joins a running publisher a moment after connecting; until then the
        engine's events are lost. Real requests are the only way to make a real engine publish.
        """
        start = self.agent.batches_applied

        async def received() -> bool:
            await self.complete(fresh_prompt(40))
            await asyncio.sleep(0.05)
            return self.agent.batches_applied > start

        await wait_until(received, "the agent to receive the engine's first KV events")

    async def complete(self, prompt: str, model: str = SERVED_MODEL, **extra: object) -> object:
        return await self.client.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra or None
        )


@pytest.fixture
async def index(redis_url: str) -> AsyncIterator[RedisBlockIndex]:
    idx = RedisBlockIndex(redis_url, key_prefix=f"e2e{free_port()}", timeout_s=1.0)
    yield idx
    await idx.close()


@pytest.fixture
async def fleet(redis_url: str) -> AsyncIterator[RedisFleetStore]:
    store = RedisFleetStore(redis_url, key_prefix=f"e2e{free_port()}:")
    yield store
    await store.close()


@pytest.fixture
async def replicas(
    vllm_engines: list[VllmEngine], index: RedisBlockIndex, fleet: RedisFleetStore
) -> AsyncIterator[list[Replica]]:
    agents = [
        ReplicaAgent(
            AgentConfig(
                replica_id=f"e2e/r{i}",
                engine_url=engine.url,
                kv_events_endpoint=engine.spec.subscriber_endpoint,
                replay_endpoint=engine.spec.replay_endpoint,
                max_cpu_loras=engine.spec.max_cpu_loras,
                listen_port=0,
            ),
            index=index,
            fleet=fleet,
        )
        for i, engine in enumerate(vllm_engines)
    ]
    for agent in agents:
        await agent.start()
    pairs = [Replica(e, a) for e, a in zip(vllm_engines, agents, strict=True)]
    try:
        for replica in pairs:
            await replica.synced()
        yield pairs
    finally:
        for replica in pairs:
            await replica.client.close()
            await replica.agent.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model: TinyModel) -> LocalTokenizer:
    return LocalTokenizer(tiny_model.model_dir)


async def test_real_engine_events_make_the_prompt_chain_match(
    replicas: list[Replica], index: RedisBlockIndex, tokenizer: LocalTokenizer
) -> None:
    r0 = replicas[0]
    assert r0.agent.applier.model == SERVED_MODEL  # discovered from the engine's /v1/models
    prompt = fresh_prompt()
    tokens = list((await tokenizer.tokenize_completion(SERVED_MODEL, prompt)).token_ids or [])
    # Same token ids as the engine's own tokenizer, so any mismatch below is about hashing.
    async with httpx.AsyncClient(base_url=r0.engine.url) as http:
        engine_tokens = (
            await http.post("/tokenize", json={"model": SERVED_MODEL, "prompt": prompt})
        ).json()["tokens"]
    assert tokens == engine_tokens
    full_blocks = len(tokens) // BLOCK_SIZE
    assert full_blocks >= 2, f"prompt too short for the test: {len(tokens)} tokens"
    chain = hash_token_blocks(tokens, BLOCK_SIZE, chain_seed(SERVED_MODEL))

    assert await index.match(chain) == {}
    await r0.complete(prompt)
    await wait_until(
        lambda: _matches(index, chain, {"e2e/r0": full_blocks}),
        f"the index to find {full_blocks} blocks of the prompt on e2e/r0",
    )
    # The engine agrees: a repeat is served from exactly those cached blocks.
    again = await r0.complete(prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks * BLOCK_SIZE  # type: ignore[attr-defined]


async def test_two_engines_are_told_apart(
    replicas: list[Replica], index: RedisBlockIndex, tokenizer: LocalTokenizer
) -> None:
    chains = []
    for replica in replicas:
        prompt = fresh_prompt()
        tokens = (await tokenizer.tokenize_completion(SERVED_MODEL, prompt)).token_ids or []
        chains.append(hash_token_blocks(tokens, BLOCK_SIZE, chain_seed(SERVED_MODEL)))
        await replica.complete(prompt)
    for i, chain in enumerate(chains):
        await wait_until(
            lambda c=chain, i=i: _matches(index, c, {f"e2e/r{i}": len(c)}),
            f"prompt {i} to match on e2e/r{i} only",
        )


async def test_chat_template_prompt_matches(
    replicas: list[Replica], index: RedisBlockIndex, tokenizer: LocalTokenizer
) -> None:
    r1 = replicas[1]
    messages = [
        {"role": "system", "content": fresh_prompt(60)},
        {"role": "user", "content": "which replica holds my prefix?"},
    ]
    tokens = (await tokenizer.tokenize_chat(SERVED_MODEL, messages)).token_ids or []
    chain = hash_token_blocks(tokens, BLOCK_SIZE, chain_seed(SERVED_MODEL))
    assert len(chain) >= 2
    await r1.client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=1, temperature=0  # type: ignore[arg-type]
    )
    await wait_until(lambda: _matches(index, chain, {"e2e/r1": len(chain)}), "chat prompt")


async def test_tools_render_into_the_chain_the_engine_caches(
    replicas: list[Replica], index: RedisBlockIndex, tokenizer: LocalTokenizer
) -> None:
    # vLLM renders a request's tools into the chat template (the tiny model's puts them first):
    # the gateway must hash that prompt, or a tool-calling request matches none of its blocks.
    r1 = replicas[1]
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": fresh_prompt(60)}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Find which replica holds a prefix.",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                },
            }
        ],
        "tool_choice": "none",  # "auto" needs a tool parser; the tools are rendered either way
    }
    variables = chat_template_variables(body)
    tokens = (await tokenizer.tokenize_chat(SERVED_MODEL, body["messages"], **variables)).token_ids
    chain = hash_token_blocks(list(tokens or []), BLOCK_SIZE, chain_seed(SERVED_MODEL))
    bare = (await tokenizer.tokenize_chat(SERVED_MODEL, body["messages"])).token_ids
    bare_chain = hash_token_blocks(list(bare or []), BLOCK_SIZE, chain_seed(SERVED_MODEL))
    assert len(chain) >= 3
    await r1.client.chat.completions.create(
        model=SERVED_MODEL, max_tokens=1, temperature=0, **body
    )
    await wait_until(lambda: _matches(index, chain, {"e2e/r1": len(chain)}), "tool chat prompt")
    assert await index.match(bare_chain) == {}  # without the tools nothing would have matched


async def test_adapter_and_cache_salt_chains_match(
    replicas: list[Replica], index: RedisBlockIndex, tokenizer: LocalTokenizer,
    tiny_model: TinyModel,
) -> None:
    r0 = replicas[0]
    adapter = "tiny-lora-1"
    async with httpx.AsyncClient(base_url=r0.engine.url) as http:
        loaded = await http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": adapter, "lora_path": str(tiny_model.adapters[adapter])},
        )
        # A previous test session's engine may already have it: vLLM answers 400 then.
        assert loaded.status_code in (200, 400), loaded.text
    prompt = fresh_prompt()
    tokens = (await tokenizer.tokenize_completion(SERVED_MODEL, prompt)).token_ids or []
    salted = hash_token_blocks(tokens, BLOCK_SIZE, chain_seed(SERVED_MODEL, adapter, "tenant-a"))
    await r0.complete(prompt, model=adapter, cache_salt="tenant-a")
    await wait_until(lambda: _matches(index, salted, {"e2e/r0": len(salted)}), "adapter chain")
    # The same tokens under the base model, another salt or no salt are different KV.
    for seed in (
        chain_seed(SERVED_MODEL),
        chain_seed(SERVED_MODEL, adapter),
        chain_seed(SERVED_MODEL, adapter, "tenant-b"),
    ):
        assert await index.match(hash_token_blocks(tokens, BLOCK_SIZE, seed)) == {}
    await wait_until(
        lambda: adapter in r0.agent.state().loaded_adapters, "adapter listed in the state"
    )


async def test_prefix_cache_reset_retires_the_epoch(
    replicas: list[Replica], index: RedisBlockIndex, tokenizer: LocalTokenizer
) -> None:
    r1 = replicas[1]
    prompt = fresh_prompt()
    tokens = (await tokenizer.tokenize_completion(SERVED_MODEL, prompt)).token_ids or []
    chain = hash_token_blocks(tokens, BLOCK_SIZE, chain_seed(SERVED_MODEL))
    await r1.complete(prompt)
    await wait_until(lambda: _matches(index, chain, {"e2e/r1": len(chain)}), "stored")
    epoch = r1.agent.applier.epoch
    async with httpx.AsyncClient(base_url=r1.engine.url) as http:
        reset = await http.post("/reset_prefix_cache")
    assert reset.status_code == 200, reset.text
    assert reset.json().get("success") is True, reset.text
    # vLLM queues AllBlocksCleared and publishes it with the next engine step: make one.
    await r1.complete(fresh_prompt(20))
    await wait_until(lambda: _matches(index, chain, {}), "AllBlocksCleared from the engine")
    assert r1.agent.applier.epoch != epoch
    assert r1.agent.metrics.value(
        "fleetgate_agent_epoch_retirements_total", reason="cleared"
    ) == 1


async def test_state_published_from_real_metrics(
    replicas: list[Replica], fleet: RedisFleetStore
) -> None:
    async def both_listed() -> bool:
        states = {s.replica_id: s for s in await fleet.list_replicas()}
        return all(
            r.agent.replica in states and states[r.agent.replica].kv_capacity_blocks
            for r in replicas
        )

    await wait_until(both_listed, "both replicas in the fleet store with cache figures")
    states = {s.replica_id: s for s in await fleet.list_replicas()}
    for replica in replicas:
        state = states[replica.agent.replica]
        assert state.url == replica.engine.url
        assert state.models == frozenset({SERVED_MODEL})
        assert state.block_size == BLOCK_SIZE
        assert state.kv_capacity_blocks and state.kv_capacity_blocks > 0
        assert state.max_loras == replica.engine.spec.max_loras
        assert state.healthy
        assert state.epoch == replica.agent.applier.epoch
    async with httpx.AsyncClient() as http:
        port = replicas[0].agent.listen_port
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    assert 'fleetgate_agent_engine_up{replica="e2e/r0"} 1.0' in text

    # cached_blocks: the engine's prefix-cache blocks by its KV events, which its KV usage
    # gauge (blocks held by running requests) does not show once the request has ended.
    r0 = replicas[0]
    before = r0.agent.applier.hashes.live_count
    assert r0.agent.snapshot is not None
    steps_before = r0.agent.snapshot.steps_total
    # The engine's step count, which the stall check watches, is exported by real vLLM.
    assert steps_before is not None
    await r0.complete(fresh_prompt())
    await wait_until(
        lambda: r0.agent.applier.hashes.live_count > before, "the new prompt's blocks stored"
    )
    await wait_until(
        lambda: (r0.agent.snapshot.steps_total or 0) > steps_before,  # type: ignore[union-attr]
        "the engine's step count moved",
    )
    assert not r0.agent.stalled

    async def published() -> bool:
        state = {s.replica_id: s for s in await fleet.list_replicas()}[r0.agent.replica]
        return state.cached_blocks == r0.agent.applier.hashes.live_count

    await wait_until(published, "cached_blocks published")
    state = {s.replica_id: s for s in await fleet.list_replicas()}[r0.agent.replica]
    assert state.cached_blocks == len(list(r0.agent.applier.hashes.live_blocks()))
    assert state.kv_capacity_blocks is not None
    assert 0 < state.cached_blocks <= state.kv_capacity_blocks


async def test_engine_restart_retires_the_epoch(
    replicas: list[Replica], index: RedisBlockIndex, tokenizer: LocalTokenizer
) -> None:
    """Stop and start a real engine on the same ports: the agent retires its entries and
    indexes the new process's events under a new epoch."""
    r1 = replicas[1]
    prompt = fresh_prompt()
    tokens = (await tokenizer.tokenize_completion(SERVED_MODEL, prompt)).token_ids or []
    chain = hash_token_blocks(tokens, BLOCK_SIZE, chain_seed(SERVED_MODEL))
    await r1.complete(prompt)
    await wait_until(lambda: _matches(index, chain, {"e2e/r1": len(chain)}), "stored")
    epoch = r1.agent.applier.epoch

    await asyncio.to_thread(r1.engine.stop)
    await wait_until(lambda: not r1.agent.engine_up, "the agent to see the engine down")
    await asyncio.to_thread(r1.engine.start)
    await asyncio.to_thread(r1.engine.wait_healthy, 300.0)
    await wait_until(lambda: r1.agent.engine_up, "the agent to see the engine back")
    assert r1.agent.applier.epoch != epoch
    assert await index.match(chain) == {}  # the new process holds nothing of the old one
    assert r1.agent.metrics.value(
        "fleetgate_agent_epoch_retirements_total", reason="restart"
    ) == 1

    await r1.synced()  # the agent's subscriber reconnected to the new process by itself
    await r1.complete(prompt)
    await wait_until(lambda: _matches(index, chain, {"e2e/r1": len(chain)}), "stored again")


async def test_replay_socket_of_a_real_engine(vllm_engine: VllmEngine) -> None:
    """vLLM's replay ROUTER answers with the buffered batches, decodable by our codec."""
    assert vllm_engine.spec.replay_endpoint is not None
    subscriber = KVEventSubscriber(
        vllm_engine.spec.subscriber_endpoint, "kv", vllm_engine.spec.replay_endpoint
    )
    try:
        async with openai.AsyncOpenAI(base_url=f"{vllm_engine.url}/v1", api_key="x") as client:
            await client.completions.create(model=SERVED_MODEL, prompt=fresh_prompt(), max_tokens=1)
        replayed = await subscriber.request_replay(0, timeout_s=10)
    finally:
        subscriber.close()
    seqs = [seq for seq, _ in replayed]
    assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert any(batch.events for _, batch in replayed)


async def _matches(index: RedisBlockIndex, chain: list[int], expected: dict[str, int]) -> bool:
    return await index.match(chain) == expected
