"""One behaviour suite for every ``BlockIndex`` backend: in-memory and real Redis.

Time-dependent cases (speculative TTLs, heartbeats) move an injected clock for the memory backend
and wait on the Redis server's own clock for Redis, polling up to a bounded deadline.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from routing.contracts import BlockIndex, IndexStats
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import MemoryBlockIndex, MirrorBlockIndex, RedisBlockIndex
from routing.types import BlockHash, Epoch, ReplicaId

R1, R2, R3 = ReplicaId("pool/r1"), ReplicaId("pool/r2"), ReplicaId("pool/r3")
E1, E2 = Epoch(1), Epoch(2)
BLOCK = 16
#: Tiny TTL for expiry cases; long enough to be sure the entry was written, short to wait for.
SHORT_TTL_S = 0.05
LONG_TTL_S = 600.0
#: Upper bound on how long Redis may take to expire a SHORT_TTL_S entry (its clock is real).
EXPIRY_DEADLINE_S = 5.0


def make_chain(blocks: int, model: str = "base") -> list[BlockHash]:
    """A chain of ``blocks`` blocks for ``model``; distinct models give disjoint chains."""
    tokens = list(range(1000, 1000 + blocks * BLOCK))
    return hash_token_blocks(tokens, BLOCK, chain_seed(model))


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """An index under test plus the one way time passes for it."""

    index: BlockIndex
    pass_time: Callable[[float, Callable[[], Awaitable[bool]]], Awaitable[None]]


class MirrorPair:
    """Two gateways' mirrors on one Redis: writes go through ``writer``, reads come from
    ``reader`` once it has applied everything in the streams, so every case also checks that
    a change reaches another gateway through Redis alone."""

    def __init__(self, writer: MirrorBlockIndex, reader: MirrorBlockIndex) -> None:
        self.writer, self.reader = writer, reader

    def __getattr__(self, name: str):  # set_epoch, retire_epoch, record, remove, heartbeat
        return getattr(self.writer, name)

    async def match(self, chain: list[BlockHash]) -> dict[ReplicaId, int]:
        await self.reader.sync()
        return await self.reader.match(chain)

    async def stats(self) -> IndexStats:
        await self.reader.sync()
        return await self.reader.stats()


@pytest.fixture(params=["memory", "redis", "mirror", "mirror-peer"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param in ("mirror", "mirror-peer"):
        clock = FakeClock()
        prefix = f"fgtest-{uuid.uuid4().hex}"
        redis_url = request.getfixturevalue("redis_url")
        mirrors = [
            MirrorBlockIndex(redis_url, key_prefix=prefix, timeout_s=2.0, clock=clock, shards=4)
            for _ in range(2 if request.param == "mirror-peer" else 1)
        ]
        for mirror in mirrors:
            await mirror.start()

        async def advance_mirror(seconds: float, done: Callable[[], Awaitable[bool]]) -> None:
            for mirror in mirrors:  # a peer times a guess or heartbeat from when it applies it
                await mirror.sync()
            clock.now += seconds
            assert await done(), f"condition still false after moving the clock {seconds}s"

        index: BlockIndex = mirrors[0] if len(mirrors) == 1 else MirrorPair(*mirrors)  # type: ignore[assignment]
        try:
            yield Backend(index, advance_mirror)
        finally:
            for mirror in mirrors:
                await mirror.close()
        return
    if request.param == "memory":
        clock = FakeClock()

        async def advance(seconds: float, done: Callable[[], Awaitable[bool]]) -> None:
            clock.now += seconds
            assert await done(), f"condition still false after moving the clock {seconds}s"

        yield Backend(MemoryBlockIndex(max_entries=10_000, clock=clock), advance)
        return

    redis_url = request.getfixturevalue("redis_url")
    index = RedisBlockIndex(redis_url, key_prefix=f"fgtest-{uuid.uuid4().hex}", timeout_s=2.0)

    async def wait(seconds: float, done: Callable[[], Awaitable[bool]]) -> None:
        # Redis expires on its own clock: poll until the condition holds, within a deadline.
        deadline = time.monotonic() + seconds + EXPIRY_DEADLINE_S
        while not await done():
            assert time.monotonic() < deadline, "condition still false at the deadline"
            await asyncio.sleep(0.01)

    try:
        yield Backend(index, wait)
    finally:
        await index.close()


# ---------------------------------------------------------------------------- matching


async def test_empty_index_and_empty_chain_match_nothing(backend: Backend) -> None:
    assert await backend.index.match(make_chain(4)) == {}
    await backend.index.record(R1, E1, make_chain(4))
    assert await backend.index.match([]) == {}


async def test_longest_prefix_per_replica(backend: Backend) -> None:
    index, chain = backend.index, make_chain(10)
    await index.set_epoch(R1, E1)
    await index.set_epoch(R2, E1)
    await index.record(R1, E1, chain[:3])
    await index.record(R2, E1, chain[:7])
    assert await index.match(chain) == {R1: 3, R2: 7}
    assert await index.match(chain[:5]) == {R1: 3, R2: 5}
    # A prompt that shares only the first two blocks.
    other = chain[:2] + make_chain(3, model="other")
    assert await index.match(other) == {R1: 2, R2: 2}


async def test_a_match_ends_at_the_first_missing_block(backend: Backend) -> None:
    index, chain = backend.index, make_chain(6)
    await index.record(R1, E1, [chain[0], chain[1], chain[3], chain[4]])
    await index.record(R2, E1, chain[1:6])  # lacks block 0: matches nothing
    assert await index.match(chain) == {R1: 2}


async def test_unrelated_chains_do_not_match(backend: Backend) -> None:
    index = backend.index
    await index.record(R1, E1, make_chain(4, model="a"))
    assert await index.match(make_chain(4, model="b")) == {}


async def test_remove_cuts_the_prefix_at_the_removed_block(backend: Backend) -> None:
    index, chain = backend.index, make_chain(6)
    await index.record(R1, E1, chain)
    await index.record(R2, E1, chain)
    await index.remove(R1, E1, [chain[2]])
    assert await index.match(chain) == {R1: 2, R2: 6}
    await index.remove(R2, E1, chain)
    assert await index.match(chain) == {R1: 2}


async def test_remove_of_another_epoch_keeps_the_live_entry(backend: Backend) -> None:
    index, chain = backend.index, make_chain(3)
    await index.set_epoch(R1, E2)
    await index.record(R1, E2, chain)
    await index.remove(R1, E1, chain)
    assert await index.match(chain) == {R1: 3}


# ---------------------------------------------------------------------------- epochs


async def test_retire_epoch_hides_every_entry_at_once(backend: Backend) -> None:
    index, chain = backend.index, make_chain(5)
    await index.set_epoch(R1, E1)
    await index.set_epoch(R2, E1)
    await index.record(R1, E1, chain)
    await index.record(R2, E1, chain[:2])
    await index.retire_epoch(R1, E1)
    assert await index.match(chain) == {R2: 2}
    # A late write under the retired epoch does not bring it back.
    await index.record(R1, E1, chain)
    assert await index.match(chain) == {R2: 2}


async def test_a_new_epoch_starts_empty_and_fills_again(backend: Backend) -> None:
    index, chain = backend.index, make_chain(5)
    await index.set_epoch(R1, E1)
    await index.record(R1, E1, chain)
    await index.set_epoch(R1, E2)  # restart: a new incarnation
    assert await index.match(chain) == {}
    await index.record(R1, E2, chain[:2])
    assert await index.match(chain) == {R1: 2}
    # A stale write from the old incarnation is dropped, not stored over the new one.
    await index.record(R1, E1, chain)
    assert await index.match(chain) == {R1: 2}


async def test_retiring_a_past_epoch_changes_nothing(backend: Backend) -> None:
    index, chain = backend.index, make_chain(3)
    await index.set_epoch(R1, E2)
    await index.record(R1, E2, chain)
    await index.retire_epoch(R1, E1)
    assert await index.match(chain) == {R1: 3}


async def test_first_write_adopts_the_epoch(backend: Backend) -> None:
    index, chain = backend.index, make_chain(3)
    await index.record(R1, E1, [])  # holds nothing: adopts nothing
    await index.record(R1, E2, chain)
    await index.record(R1, E1, chain[:1])  # not the adopted epoch: dropped
    assert await index.match(chain) == {R1: 3}


# ---------------------------------------------------------------------------- speculative entries


async def test_speculative_entries_match_until_they_expire(backend: Backend) -> None:
    index, chain = backend.index, make_chain(4)
    await index.record(R1, E1, chain, ttl_s=LONG_TTL_S)
    await index.record(R2, E1, chain)
    await index.record(R3, E1, chain, ttl_s=SHORT_TTL_S)

    async def r3_expired() -> bool:
        return R3 not in await index.match(chain)

    await backend.pass_time(SHORT_TTL_S, r3_expired)
    assert await index.match(chain) == {R1: 4, R2: 4}


async def test_confirmed_entries_replace_and_outlive_speculative_ones(backend: Backend) -> None:
    index, chain = backend.index, make_chain(4)
    await index.record(R1, E1, chain, ttl_s=SHORT_TTL_S)
    await index.record(R1, E1, chain[:3])  # the engine confirms three of the four blocks
    await index.record(R2, E1, chain, ttl_s=SHORT_TTL_S)  # control: expires at the same time
    await index.record(R1, E1, chain[:2], ttl_s=SHORT_TTL_S)  # a later guess must not downgrade

    async def control_expired() -> bool:
        return R2 not in await index.match(chain)

    await backend.pass_time(SHORT_TTL_S, control_expired)
    assert await index.match(chain) == {R1: 3}


# ---------------------------------------------------------------------------- heartbeats


async def test_a_silent_replica_stops_matching_until_it_heartbeats(backend: Backend) -> None:
    index, chain = backend.index, make_chain(3)
    await index.record(R1, E1, chain)
    await index.record(R2, E1, chain)  # never heartbeats: not held to a deadline
    await index.heartbeat(R1, SHORT_TTL_S)

    async def r1_silent() -> bool:
        return await index.match(chain) == {R2: 3}

    await backend.pass_time(SHORT_TTL_S, r1_silent)
    await index.heartbeat(R1, LONG_TTL_S)
    assert await index.match(chain) == {R1: 3, R2: 3}


# ---------------------------------------------------------------------------- stats and input


async def test_stats_count_blocks_and_live_replicas(backend: Backend) -> None:
    index, chain = backend.index, make_chain(5)
    await index.record(R1, E1, chain[:3])
    await index.record(R2, E1, chain)
    await index.record(R3, E1, chain[:1])
    await index.retire_epoch(R3, E1)
    stats = await index.stats()
    assert isinstance(stats, IndexStats)
    assert stats.backend in {"memory", "redis", "mirror"}
    assert (stats.entries, stats.replicas) == (5, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ix: ix.record(ReplicaId(""), E1, []), "replica must be a non-empty string"),
        (lambda ix: ix.record(R1, Epoch(-1), []), "epoch must be a non-negative integer"),
        (lambda ix: ix.record(R1, E1, [], ttl_s=0), "ttl_s must be a finite number"),
        (lambda ix: ix.record(R1, E1, [BlockHash(-3)]), r"blocks\[0\] must be a block hash"),
        (lambda ix: ix.remove(R1, E1, ["x"]), r"blocks\[0\] must be a block hash"),
        (lambda ix: ix.heartbeat(R1, float("inf")), "ttl_s must be a finite number"),
        (lambda ix: ix.set_epoch(R1, True), "epoch must be a non-negative integer"),
    ],
)
async def test_bad_input_is_refused(backend: Backend, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await call(backend.index)


async def test_a_match_never_extends_a_block_held_only_by_guesses(redis_url: str) -> None:
    """Lookup mode refreshes a matched block's TTL (a hit keeps it alive), but only where some
    replica confirmed holding it: a guess-only block lives as long as its longest guess."""
    import redis.asyncio as aioredis

    prefix = f"fgtest-{uuid.uuid4().hex}"
    index = RedisBlockIndex(redis_url, key_prefix=prefix, timeout_s=2.0)
    client = aioredis.Redis.from_url(redis_url)
    try:
        guessed, confirmed = make_chain(3, model="guessed"), make_chain(3, model="confirmed")
        await index.record(R1, E1, guessed, ttl_s=5.0)
        await index.record(R1, E1, confirmed)
        assert await index.match(guessed) == {R1: 3}
        assert await index.match(confirmed) == {R1: 3}
        ttls = {}
        async for key in client.scan_iter(match=f"{{{prefix}}}*"):  # the hash tag {prefix}
            ttls[key] = await client.pttl(key)
        block_ttls = sorted(t for t in ttls.values() if t > 0)
        # Three guess-only blocks still within their 5 s; the confirmed ones refreshed to hours.
        assert [t <= 5_000 for t in block_ttls].count(True) == 3
        assert all(t > 60_000 for t in block_ttls[3:])
    finally:
        await client.aclose()
        await index.close()
