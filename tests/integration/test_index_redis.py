"""What only the Redis index does: key layout and TTLs, NOSCRIPT recovery, outages, timeouts."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from routing.contracts import IndexUnavailable
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import RedisBlockIndex
from routing.types import Epoch, ReplicaId
from tests.integration.test_index_redis_slots import block_value
from tests.support.redis_server import RedisServer

R1 = ReplicaId("pool/r1")
E1 = Epoch(1)
CHAIN = hash_token_blocks(list(range(64)), 16, chain_seed("base"))


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield redis
    finally:
        await redis.aclose()


def unique_prefix() -> str:
    return f"fgtest-{uuid.uuid4().hex}"


async def test_every_key_shares_one_hash_tag(client: aioredis.Redis, redis_url: str) -> None:
    prefix = unique_prefix()
    index = RedisBlockIndex(client, key_prefix=prefix)
    await index.set_epoch(R1, E1)
    await index.heartbeat(R1, 60)
    await index.record(R1, E1, CHAIN)
    keys = sorted([key async for key in client.scan_iter(match=f"{{{prefix}}}:*")])
    expected_blocks = sorted(f"{{{prefix}}}:b:{block:016x}" for block in CHAIN)
    tables = [f"{{{prefix}}}:{name}" for name in ("alive", "epochs", "meta", "owners", "slots")]
    assert keys == sorted([*tables, *expected_blocks])
    await index.set_epoch(R1, Epoch(2))  # the first dead incarnation creates the quarantine
    keys.append(f"{{{prefix}}}:dead")
    # One cluster slot for the whole index: a Lua script may touch all of it.
    assert {key_slot(key.encode()) for key in keys} == {key_slot(prefix.encode())}
    assert await client.hget(f"{{{prefix}}}:epochs", R1) == "2"
    # Epoch 1 had slot 0 (bit 7 of byte 0); epoch 2 got slot 1 while slot 0 is quarantined.
    assert await client.hget(f"{{{prefix}}}:slots", R1) == "1"
    assert await client.hgetall(f"{{{prefix}}}:owners") == {"1": R1}
    assert await client.zrange(f"{{{prefix}}}:dead", 0, -1) == ["0"]
    raw = aioredis.Redis.from_url(redis_url)  # bitsets are bytes, not UTF-8
    try:
        assert await block_value(raw, index, CHAIN[0]) == (b"\x80", {})
    finally:
        await raw.aclose()


async def test_block_keys_expire_and_a_guess_never_shortens_a_confirmed_ttl(
    client: aioredis.Redis,
) -> None:
    index = RedisBlockIndex(client, key_prefix=unique_prefix(), block_ttl_s=100)
    await index.record(R1, E1, CHAIN[:1], ttl_s=2)  # speculative only: the key dies with it
    guess_ttl = await client.pttl(index.block_key(CHAIN[0]))
    assert 0 < guess_ttl <= 2000
    await index.record(R1, E1, CHAIN[:1])  # confirmed: the key lives block_ttl_s
    await index.record(ReplicaId("pool/r2"), E1, CHAIN[:1], ttl_s=2)
    confirmed_ttl = await client.pttl(index.block_key(CHAIN[0]))
    assert 2000 < confirmed_ttl <= 100_000


async def test_script_flush_is_survived(client: aioredis.Redis) -> None:
    index = RedisBlockIndex(client, key_prefix=unique_prefix())
    await index.record(R1, E1, CHAIN)
    await client.script_flush()
    assert await index.match(CHAIN) == {R1: len(CHAIN)}


async def test_close_leaves_a_callers_client_open(client: aioredis.Redis) -> None:
    index = RedisBlockIndex(client, key_prefix=unique_prefix())
    await index.close()
    assert await client.ping()


async def test_redis_outage_raises_index_unavailable_then_recovers(
    redis_server: RedisServer,
) -> None:
    index = RedisBlockIndex(redis_server.url, key_prefix=unique_prefix(), timeout_s=1.0)
    try:
        await index.record(R1, E1, CHAIN)
        assert await index.match(CHAIN) == {R1: len(CHAIN)}
        redis_server.stop()
        for call in (
            lambda: index.match(CHAIN),
            lambda: index.record(R1, E1, CHAIN),
            lambda: index.remove(R1, E1, CHAIN),
            lambda: index.set_epoch(R1, E1),
            lambda: index.retire_epoch(R1, E1),
            lambda: index.heartbeat(R1, 5),
            index.stats,
        ):
            with pytest.raises(IndexUnavailable, match="redis block index"):
                await call()
        # Back on the same port, empty (no persistence) and without our scripts loaded.
        redis_server.start()
        assert await index.match(CHAIN) == {}
        await index.record(R1, E1, CHAIN[:2])
        assert await index.match(CHAIN) == {R1: 2}
    finally:
        await index.close()


async def test_a_redis_that_never_answers_times_out() -> None:
    release = asyncio.Event()

    async def accept_and_stay_silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await release.wait()
        writer.close()

    server = await asyncio.start_server(accept_and_stay_silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    index = RedisBlockIndex(f"redis://127.0.0.1:{port}/0", timeout_s=0.05)
    try:
        with pytest.raises(IndexUnavailable, match="match failed"):
            await index.match(CHAIN)
    finally:
        release.set()
        await index.close()
        server.close()
        await server.wait_closed()


async def test_a_bytes_client_and_required_heartbeats(redis_url: str) -> None:
    raw = aioredis.Redis.from_url(redis_url)  # no decode_responses: replies are bytes
    index = RedisBlockIndex(raw, key_prefix=unique_prefix(), require_heartbeat=True)
    try:
        await index.record(R1, E1, CHAIN)
        assert await index.match(CHAIN) == {}  # never heartbeated: held to the requirement
        await index.heartbeat(R1, 60)
        assert await index.match(CHAIN) == {R1: len(CHAIN)}
        assert (await index.stats()).replicas == 1
    finally:
        await raw.aclose()
