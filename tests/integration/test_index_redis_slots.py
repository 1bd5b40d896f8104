"""The Redis index's incarnation slots: exact against a plain model, slots recycled safely."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from routing.index import RedisBlockIndex
from routing.types import BlockHash, Epoch, ReplicaId
from tests.unit.test_index_memory_bits import ReferenceIndex

#: Long enough that nothing expires during a test: the random test has no clock to move.
LONG_S = 600.0


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A bytes client: block bitsets are binary."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


async def block_value(
    raw: aioredis.Redis, index: RedisBlockIndex, block: BlockHash
) -> tuple[bytes, dict[int, int]] | None:
    """A block key's confirmed-holder bitset and speculative ``slot -> expiry``, as stored.

    Layout (routing/index/redis_scripts.py): 2-byte length, bitset, refresh time, guesses.
    """
    value = await raw.get(index.block_key(block))
    if value is None:
        return None
    length = int.from_bytes(value[:2], "big")
    bitset, rest = value[2 : 2 + length], value[2 + length :].decode()
    time_s, *guesses = rest.split(" ")
    assert time_s.isdigit()
    return bitset, {int(g.split(":")[0]): int(g.split(":")[1]) for g in guesses}


def new_index(client: aioredis.Redis, **opts: object) -> RedisBlockIndex:
    return RedisBlockIndex(client, key_prefix=f"fgtest-{uuid.uuid4().hex}", **opts)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(6))
async def test_matches_agree_with_a_plain_model_under_random_operations(
    raw: aioredis.Redis, seed: int
) -> None:
    rng = random.Random(seed)
    require_heartbeat = seed % 3 == 0
    index = new_index(raw, require_heartbeat=require_heartbeat, timeout_s=2.0)
    model = ReferenceIndex(require_heartbeat)
    now = 0.0  # nothing expires: TTLs and heartbeats are LONG_S
    replicas = [ReplicaId(f"pool/r{i}") for i in range(11)]  # two bytes of slots and more
    next_epoch = {replica: 1 for replica in replicas}
    chains = [[BlockHash(1000 * c + b) for b in range(12)] for c in range(3)]
    chains.append(chains[0][:5] + [BlockHash(9000 + b) for b in range(6)])
    for _ in range(300):
        replica = rng.choice(replicas)
        chain = rng.choice(chains)
        op = rng.random()
        if op < 0.4:
            epoch = model.epochs.get(replica) or Epoch(next_epoch[replica])
            if rng.random() < 0.1:
                epoch = Epoch(epoch + 1000)
            start = rng.randrange(0, 3)
            blocks = chain[start : rng.randrange(start, len(chain) + 1)]
            ttl = rng.choice([None, None, LONG_S])
            await index.record(replica, epoch, blocks, ttl_s=ttl)
            model.record(replica, epoch, blocks, None if ttl is None else now + ttl)
        elif op < 0.5:
            epoch = model.epochs.get(replica) or Epoch(1)
            blocks = rng.sample(chain, rng.randrange(1, 4))
            await index.remove(replica, epoch, blocks)
            model.remove(replica, epoch, blocks)
        elif op < 0.57:
            next_epoch[replica] += 1
            await index.set_epoch(replica, Epoch(next_epoch[replica]))
            model.epochs[replica] = Epoch(next_epoch[replica])
        elif op < 0.63:
            live = model.epochs.get(replica)
            if live is not None:
                await index.retire_epoch(replica, live)
                model.epochs[replica] = None
                next_epoch[replica] += 1
        elif op < 0.68:
            await index.heartbeat(replica, LONG_S)
            model.deadlines[replica] = now + LONG_S
        else:
            query = chain[: rng.randrange(0, len(chain) + 1)]
            assert await index.match(query) == model.match(query, now)
    for chain in chains:
        assert await index.match(chain) == model.match(chain, now)


async def test_a_lookup_clears_dead_bits_from_the_blocks_it_touches(raw: aioredis.Redis) -> None:
    index = new_index(raw)
    r1, r2 = ReplicaId("pool/r1"), ReplicaId("pool/r2")
    chain = [BlockHash(v) for v in range(1, 4)]
    await index.set_epoch(r1, Epoch(1))  # slot 0
    await index.set_epoch(r2, Epoch(1))  # slot 1
    await index.record(r1, Epoch(1), chain)
    await index.record(r2, Epoch(1), chain, ttl_s=LONG_S)
    # Confirmed by slot 0 (bit 7 of byte 0), guessed by slot 1.
    value = await block_value(raw, index, chain[0])
    assert value is not None and value[0] == b"\x80" and list(value[1]) == [1]
    await index.retire_epoch(r1, Epoch(1))
    await index.retire_epoch(r2, Epoch(1))
    await index.set_epoch(r2, Epoch(2))  # slot 2: 0 and 1 are quarantined
    await index.record(r2, Epoch(2), chain[:1])
    # The write cleared both dead slots from block 0 before extending its TTL.
    assert await block_value(raw, index, chain[0]) == (b"\x20", {})
    assert await index.match(chain) == {r2: 1}
    # Block 1 was met by the walk (r2 lacks it): untouched, its dead bits wait for a write, a
    # hit or expiry, which is safe as its TTL was not extended.
    assert await block_value(raw, index, chain[1]) == value
    await index.set_epoch(r1, Epoch(2))  # slot 3
    await index.record(r1, Epoch(2), chain)
    assert await index.match(chain) == {r1: 3, r2: 1}
    assert await block_value(raw, index, chain[2]) == (b"\x10", {})


async def test_a_slot_is_reused_only_after_every_key_holding_it_has_expired(
    raw: aioredis.Redis,
) -> None:
    # Tiny key TTLs so the quarantine (longest TTL + 1 s) passes within the test.
    index = new_index(raw, block_ttl_s=0.2, timeout_s=2.0)
    r1, r2 = ReplicaId("pool/r1"), ReplicaId("pool/r2")
    chain = [BlockHash(v) for v in range(1, 6)]
    await index.record(r1, Epoch(1), chain)  # adopts epoch 1, slot 0
    await index.set_epoch(r1, Epoch(2))  # slot 0 dies; epoch 2 takes slot 1
    await index.set_epoch(r2, Epoch(1))  # slot 0 is still quarantined: slot 2
    slots = f"{{{index.key_prefix}}}:slots"
    assert await raw.hgetall(slots) == {b"pool/r1": b"1", b"pool/r2": b"2"}
    await index.set_epoch(r2, Epoch(2))
    assert await raw.hget(slots, r2) == b"3"
    dead_key = f"{{{index.key_prefix}}}:dead"
    deadline = time.monotonic() + 10.0
    while True:  # wait, on the server's clock, for slot 0's quarantine to end
        seconds, micros = await raw.time()
        if await raw.zscore(dead_key, "0") <= seconds * 1000 + micros // 1000:
            break
        assert time.monotonic() < deadline, "slot 0 never left quarantine"
        await asyncio.sleep(0.1)
    # By then every key that could hold slot 0's bit has expired ...
    assert await raw.exists(*(index.block_key(block) for block in chain)) == 0
    # ... so the incarnation that reuses it inherits nothing.
    r3 = ReplicaId("pool/r3")
    await index.set_epoch(r3, Epoch(1))
    assert await raw.hget(slots, r3) == b"0"
    assert await index.match(chain) == {}
    await index.record(r3, Epoch(1), chain[:2])
    assert await index.match(chain) == {r3: 2}


async def test_a_write_for_a_live_epoch_without_a_slot_gets_one(raw: aioredis.Redis) -> None:
    # An epochs table written by an older fleetgate (no slots yet) keeps working.
    index = new_index(raw)
    r1 = ReplicaId("pool/r1")
    await raw.hset(f"{{{index.key_prefix}}}:epochs", r1, "4")
    chain = [BlockHash(v) for v in range(3)]
    await index.record(r1, Epoch(4), chain)
    assert await index.match(chain) == {r1: 3}


async def test_a_hit_clears_dead_bits_before_it_extends_the_key(raw: aioredis.Redis) -> None:
    index = new_index(raw, block_ttl_s=100)
    r1, r2 = ReplicaId("pool/r1"), ReplicaId("pool/r2")
    chain = [BlockHash(v) for v in range(1, 4)]
    await index.record(r1, Epoch(1), chain)  # slot 0
    await index.record(r2, Epoch(1), chain)  # slot 1
    assert await block_value(raw, index, chain[2]) == (b"\xc0", {})
    await index.retire_epoch(r1, Epoch(1))
    # Extended just now: a hit leaves the keys alone (no write), dead bit included.
    assert await index.match(chain) == {r2: 3}
    assert await block_value(raw, index, chain[0]) == (b"\xc0", {})
    # Pretend the last extension is old (t = 0) and the TTL has run down: the next hit extends
    # the TTL, and drops the dead bit first.
    for block in chain:
        key = index.block_key(block)
        await raw.set(key, b"\x00\x01\xc00", px=5_000)
    assert await index.match(chain) == {r2: 3}
    for block in chain:
        assert await block_value(raw, index, block) == (b"\x40", {})
        assert await raw.pttl(index.block_key(block)) > 90_000


async def test_long_chains_are_read_in_slices_without_losing_a_block(raw: aioredis.Redis) -> None:
    # Slices of 32 blocks: depths on both sides of slice boundaries.
    index = new_index(raw)
    chain = [BlockHash(10_000 + b) for b in range(300)]
    depths = {ReplicaId(f"pool/r{d}"): d for d in (1, 31, 32, 33, 63, 64, 65, 255, 256, 300)}
    for replica, depth in depths.items():
        await index.record(replica, Epoch(1), chain[:depth])
    assert await index.match(chain) == depths
    assert await index.match(chain[:33]) == {r: min(d, 33) for r, d in depths.items()}
    await index.remove(ReplicaId("pool/r300"), Epoch(1), [chain[200]])
    assert (await index.match(chain))[ReplicaId("pool/r300")] == 200
