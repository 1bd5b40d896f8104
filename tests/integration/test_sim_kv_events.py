"""KV events of a simulated replica, received by a real ZMQ subscriber and decoded."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import aiohttp
import pytest

from replica.kv_events import BlockStored, EventBatch, KVEventSubscriber
from replica.sim.fleet import SimFleet, start_sim_fleet

PROMPT = "a long shared prefix for the event stream " * 10


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with start_sim_fleet(1, profile="tiny", speed=1000, max_loras=2) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _complete(http: aiohttp.ClientSession, url: str, **body: object) -> dict[str, object]:
    payload = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2, **body}
    async with http.post(url + "/v1/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def _tokens(http: aiohttp.ClientSession, url: str, prompt: str) -> list[int]:
    async with http.post(url + "/tokenize", json={"prompt": prompt}) as resp:
        return list((await resp.json())["tokens"])


def _stored(batches: list[tuple[int, EventBatch]]) -> list[BlockStored]:
    return [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]


async def test_block_stored_events_carry_the_prompt_tokens(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    await _complete(http, url)
    sub = KVEventSubscriber(fleet.kv_event_endpoints[0] or "",
                            replay_endpoint=fleet.kv_replay_endpoints[0])
    with sub:
        # Replay is reliable (no PUB/SUB slow joiner): everything since seq 0.
        batches = await sub.request_replay(0)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    stored = _stored(batches)
    assert stored, "a completed request must have stored blocks"
    block_size = fleet.replicas[0].replica.engine_config.block_size
    prompt = await _tokens(http, url, PROMPT)
    root = stored[0]
    assert root.parent_block_hash is None
    assert root.block_size == block_size
    assert root.medium == "GPU"
    assert len(root.token_ids) == len(root.block_hashes) * block_size
    # The stored chain, concatenated, is the prompt's full blocks.
    chain_tokens = [t for event in stored for t in event.token_ids]
    full = len(prompt) // block_size * block_size
    assert chain_tokens[:full] == prompt[:full]
    for parent, child in itertools.pairwise(stored):
        assert child.parent_block_hash == parent.block_hashes[-1]
    assert all(isinstance(h, int) for e in stored for h in e.block_hashes)


async def test_live_subscription_sees_adapter_and_salt(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    load = {"lora_name": "ft-1", "lora_path": "/a/ft-1"}
    async with http.post(url + "/v1/load_lora_adapter", json=load) as resp:
        assert resp.status == 200
    sub = KVEventSubscriber(fleet.kv_event_endpoints[0] or "")
    with sub:
        # PUB/SUB drops what is sent before the subscription lands: probe with fresh prompts
        # until one batch arrives, then every later batch must arrive in order.
        seq = -1
        for probe in range(200):
            await _complete(http, url, prompt=f"probe {probe} " * 20)
            try:
                seq, _ = await asyncio.wait_for(sub.recv(), timeout=0.05)
                break
            except TimeoutError:
                continue
        else:
            raise AssertionError("no KV event batch ever reached the subscriber")
        publisher = fleet.replicas[0].replica.publisher
        assert publisher is not None
        while seq < publisher.next_seq - 1:  # drain what the probes left in flight
            seq, _ = await sub.recv()

        await _complete(http, url, model="ft-1", cache_salt="tenant-a")
        next_seq, batch = await sub.recv()
        assert next_seq == seq + 1
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored
        root = stored[0]
        assert root.lora_name == "ft-1"
        assert root.lora_id is not None and root.lora_id >= 1
        assert root.parent_block_hash is None
        assert root.extra_keys is not None
        assert len(root.extra_keys) == len(root.block_hashes)
        assert root.extra_keys[0] == ("ft-1", "tenant-a")
        assert all(keys == ("ft-1",) for keys in root.extra_keys[1:])


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    await _complete(http, url)
    async with http.post(url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    # The next engine step publishes the reset; a completed request proves one has run.
    await _complete(http, url)
    sub = KVEventSubscriber(fleet.kv_event_endpoints[0] or "",
                            replay_endpoint=fleet.kv_replay_endpoints[0])
    with sub:
        batches = await sub.request_replay(0)
    kinds = [type(e).__name__ for _, b in batches for e in b.events]
    assert "AllBlocksCleared" in kinds
    cleared_at = kinds.index("AllBlocksCleared")
    # Blocks were stored before the reset, and the same prompt is stored again after it.
    assert "BlockStored" in kinds[:cleared_at]
    assert "BlockStored" in kinds[cleared_at:]
