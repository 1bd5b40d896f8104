"""The in-memory index reclaims expired speculative entries, a bounded number of blocks per call.

Every case moves an injected clock: nothing here waits on real time or measures it.
"""

from __future__ import annotations

import math

import pytest

from routing.index import MemoryBlockIndex
from routing.types import BlockHash, Epoch, ReplicaId

R1, R2 = ReplicaId("r1"), ReplicaId("r2")
E1, E2 = Epoch(1), Epoch(2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def chain(request: int, length: int = 20) -> list[BlockHash]:
    """A chain of blocks unique to one request (as a fresh user turn makes)."""
    return [BlockHash(1_000_000 + request * 1_000 + b) for b in range(length)]


CONFIRMED = [BlockHash(v) for v in range(1, 11)]
UNRELATED = [BlockHash(999)]


async def entries(index: MemoryBlockIndex) -> int:
    return (await index.stats()).entries


async def test_lookups_alone_reclaim_expired_entries_a_bounded_step_at_a_time() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock, reclaim_step=50)
    await index.record(R1, E1, CONFIRMED)
    for request in range(200):
        await index.record(R2, E1, chain(request), ttl_s=5.0)
        clock.now += 0.01
    assert await entries(index) == 10 + 200 * 20
    clock.now += 5.0  # every guess has expired
    assert await index.match(UNRELATED) == {}
    assert await entries(index) == 10 + 200 * 20 - 50  # one step: at most reclaim_step blocks
    for _ in range(math.ceil(200 * 20 / 50) - 1):
        await index.match(UNRELATED)
    stats = await index.stats()
    assert stats.entries == 10  # back to the confirmed-only size
    assert stats.extra["speculative_blocks"] == 0
    assert stats.extra["reclaimed"] == 200 * 20
    assert stats.extra["reclaim_queue_blocks"] == 0
    assert await index.match(CONFIRMED) == {R1: 10}


async def test_a_write_reclaims_at_least_as_many_blocks_as_it_adds() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock, reclaim_step=1)
    await index.record(R1, E1, CONFIRMED)
    for request in range(100):
        await index.record(R2, E1, chain(request), ttl_s=1.0)
        clock.now += 2.0  # each write's guesses have expired by the next write
    # Each write reclaimed the previous one (20 blocks, within 1 + 20): only the last is left.
    assert await entries(index) == 10 + 20
    clock.now += 2.0
    await index.record(R1, E1, CONFIRMED)  # a confirmed write reclaims too: 1 + its 10 blocks
    assert await entries(index) == 10 + 20 - 11
    await index.record(R1, E1, CONFIRMED)
    assert await entries(index) == 10


async def test_a_gateway_soak_holds_about_rate_times_ttl_blocks() -> None:
    """Per request: a lookup, then a guess on a chain no later request repeats."""
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    await index.record(R1, E1, CONFIRMED)
    ttl_s, interval_s, length = 1.0, 0.01, 30
    largest = 0
    for request in range(5_000):
        request_chain = CONFIRMED + chain(request, length)
        await index.match(request_chain)
        await index.record(R2, E1, request_chain, ttl_s=ttl_s)
        clock.now += interval_s
        largest = max(largest, await entries(index))
    # Guesses written within one TTL, plus one write not reclaimed yet; never 5,000 x 30.
    assert largest <= 10 + (ttl_s / interval_s + 2) * length
    stats = await index.stats()
    assert stats.extra["evictions"] == 0
    assert stats.extra["reclaim_queue_blocks"] <= (ttl_s / interval_s + 2) * (10 + length)


async def test_unequal_ttls_are_reclaimed_in_expiry_order() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    await index.record(R1, E1, chain(1), ttl_s=10.0)  # written first, expires last
    await index.record(R1, E1, chain(2), ttl_s=1.0)
    clock.now += 2.0
    await index.match(UNRELATED)
    assert await entries(index) == 20  # chain 2 reclaimed though written after chain 1
    assert await index.match(chain(1)) == {R1: 20}
    clock.now += 10.0
    await index.match(UNRELATED)
    assert await entries(index) == 0


async def test_a_rewritten_guess_is_reclaimed_only_when_the_newer_one_expires() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    await index.record(R1, E1, chain(1), ttl_s=1.0)
    clock.now += 0.5
    await index.record(R1, E1, chain(1), ttl_s=1.0)  # the same guess, renewed
    clock.now += 0.7  # the first write has expired, the renewal has not
    await index.match(UNRELATED)
    assert await entries(index) == 20
    assert await index.match(chain(1)) == {R1: 20}
    clock.now += 0.4
    await index.match(UNRELATED)
    assert await entries(index) == 0


async def test_reclaiming_a_guess_keeps_confirmed_entries_and_other_replicas_guesses() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    blocks = chain(1, 4)
    await index.record(R1, E1, blocks, ttl_s=1.0)
    await index.record(R1, E1, blocks[:1])  # the engine confirms block 0
    await index.record(R2, E1, blocks[:3])  # another replica holds blocks 0-2
    clock.now += 0.5
    await index.record(R2, E1, blocks[3:], ttl_s=1.0)  # and guesses block 3
    clock.now += 0.6  # R1's guesses expired, R2's has not
    await index.match(UNRELATED)
    stats = await index.stats()
    assert (stats.entries, stats.extra["speculative_blocks"]) == (4, 1)
    assert await index.match(blocks) == {R1: 1, R2: 4}
    clock.now += 1.0
    await index.match(UNRELATED)
    assert await entries(index) == 3  # block 3 held only R2's guess
    assert await index.match(blocks) == {R1: 1, R2: 3}


async def test_a_block_left_with_only_dead_incarnations_is_dropped() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    blocks = chain(1, 3)
    await index.record(R2, E1, blocks)
    await index.set_epoch(R2, E2)  # R2's entries of epoch 1 are dead
    await index.record(R1, E1, blocks, ttl_s=1.0)
    clock.now += 1.0
    await index.match(UNRELATED)
    assert await entries(index) == 0


async def test_the_lru_bound_holds_and_bounds_the_reclaim_queue() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(max_entries=50, clock=clock)
    for request in range(40):
        await index.record(R1, E1, chain(request, 9), ttl_s=1_000.0)
        stats = await index.stats()
        assert stats.entries <= 50
        assert stats.extra["reclaim_queue_blocks"] <= 2 * 50
        clock.now += 1.0
    stats = await index.stats()
    assert (stats.entries, stats.extra["evictions"]) == (50, 40 * 9 - 50)
    clock.now += 1_000.0
    for _ in range(2):  # 11 writes of 9 blocks are queued; a lookup reclaims 64 blocks at most
        await index.match(UNRELATED)
    assert await entries(index) == 0  # the writes still queued cover every surviving guess


async def test_a_dropped_write_is_not_queued() -> None:
    index = MemoryBlockIndex()
    await index.set_epoch(R1, E2)
    await index.record(R1, E1, chain(1), ttl_s=1.0)  # not the live epoch: dropped
    stats = await index.stats()
    assert (stats.entries, stats.extra["reclaim_queue_blocks"]) == (0, 0)


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_reclaim_step_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ValueError, match="reclaim_step must be a positive integer"):
        MemoryBlockIndex(reclaim_step=value)  # type: ignore[arg-type]
