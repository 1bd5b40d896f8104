"""What only the in-memory index does: the LRU bound, exact expiry on its clock, the factory.

Reclaiming expired speculative entries is in ``test_index_memory_reclaim.py``.
"""

from __future__ import annotations

import pytest

from routing.contracts import BlockIndex
from routing.index import MemoryBlockIndex, MirrorBlockIndex, RedisBlockIndex, build_index
from routing.types import BlockHash, Epoch, ReplicaId

R1, R2 = ReplicaId("r1"), ReplicaId("r2")
E1 = Epoch(1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def blocks(*values: int) -> list[BlockHash]:
    return [BlockHash(value) for value in values]


async def test_lru_bound_evicts_the_least_recently_used_block() -> None:
    index = MemoryBlockIndex(max_entries=3)
    await index.record(R1, E1, blocks(1))
    await index.record(R1, E1, blocks(2))
    await index.record(R1, E1, blocks(3))
    assert await index.match(blocks(1)) == {R1: 1}  # a hit makes block 1 the youngest
    await index.record(R1, E1, blocks(4))  # evicts block 2, the oldest untouched
    assert await index.match(blocks(2)) == {}
    assert await index.match(blocks(1)) == {R1: 1}
    assert await index.match(blocks(3, 4)) == {R1: 2}
    stats = await index.stats()
    assert (stats.entries, stats.max_entries, stats.extra["evictions"]) == (3, 3, 1)


async def test_a_long_record_keeps_only_its_newest_blocks() -> None:
    index = MemoryBlockIndex(max_entries=4)
    chain = blocks(*range(10, 20))
    await index.record(R1, E1, chain)
    assert (await index.stats()).entries == 4
    assert await index.match(chain) == {}  # the chain's head was evicted, so no prefix is left
    assert await index.match(chain[6:]) == {R1: 4}


@pytest.mark.parametrize(
    ("ttl_s", "elapsed_s", "matches"),
    [(10.0, 0.0, True), (10.0, 9.99, True), (10.0, 10.0, False), (10.0, 30.0, False)],
)
async def test_speculative_expiry_on_the_injected_clock(
    ttl_s: float, elapsed_s: float, matches: bool
) -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    await index.record(R1, E1, blocks(1, 2), ttl_s=ttl_s)
    clock.now += elapsed_s
    assert await index.match(blocks(1, 2)) == ({R1: 2} if matches else {})


async def test_dead_entries_are_dropped_when_a_lookup_meets_them() -> None:
    index = MemoryBlockIndex()
    await index.record(R1, E1, blocks(1))
    await index.record(R2, E1, blocks(5))
    await index.record(R2, E1, blocks(6))
    await index.retire_epoch(R2, E1)
    assert await index.match(blocks(5)) == {}
    assert (await index.stats()).entries == 2  # blocks 1 and 6; 6 was never reached by a lookup


@pytest.mark.parametrize(
    ("require_heartbeat", "heartbeat_ttl_s", "expected"),
    [
        (False, None, {R1: 1}),
        (True, None, {}),
        (True, 5.0, {R1: 1}),
        (False, 0.5, {}),
    ],
)
async def test_heartbeat_policy(
    require_heartbeat: bool, heartbeat_ttl_s: float | None, expected: dict[ReplicaId, int]
) -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock, require_heartbeat=require_heartbeat)
    await index.record(R1, E1, blocks(7))
    if heartbeat_ttl_s is not None:
        await index.heartbeat(R1, heartbeat_ttl_s)
    clock.now += 1.0
    assert await index.match(blocks(7)) == expected


@pytest.mark.parametrize("max_entries", [0, -1, 1.5, True])
def test_max_entries_must_be_a_positive_integer(max_entries: object) -> None:
    with pytest.raises(ValueError, match="max_entries must be a positive integer"):
        MemoryBlockIndex(max_entries=max_entries)  # type: ignore[arg-type]


async def test_build_index_picks_the_backend_from_the_url() -> None:
    for url in (None, "", "memory"):
        assert isinstance(build_index(url), MemoryBlockIndex)
    assert (await build_index("memory", max_entries=7).stats()).max_entries == 7
    redis_index = build_index("redis://127.0.0.1:1/0", mode="lookup", key_prefix="fg-a")
    assert isinstance(redis_index, RedisBlockIndex)  # no connection is made before the first call
    assert redis_index.block_key(BlockHash(12)) == "{fg-a}:b:000000000000000c"
    await redis_index.close()
    # Mirror mode is the default for a Redis URL; nothing connects before start or first use.
    mirror = build_index("redis://127.0.0.1:1/0", key_prefix="fg-a")
    assert isinstance(mirror, MirrorBlockIndex)
    assert mirror.layout.key_prefix == "fg-a"
    await mirror.close()
    assert isinstance(build_index(), BlockIndex)
    with pytest.raises(ValueError, match="index mode must be one of lookup, mirror"):
        build_index("redis://127.0.0.1:1/0", mode="mirrored")


@pytest.mark.parametrize("url", ["postgres://x", "mem", "http://redis:6379"])
def test_build_index_refuses_unknown_urls(url: str) -> None:
    with pytest.raises(ValueError, match="index url must be 'memory', a redis://"):
        build_index(url)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key_prefix": ""}, "key_prefix must be a non-empty string"),
        ({"key_prefix": "a{b}"}, "key_prefix must not contain"),
        ({"timeout_s": 0}, "timeout_s must be a finite number"),
        ({"block_ttl_s": -1}, "block_ttl_s must be a finite number"),
    ],
)
def test_redis_index_refuses_bad_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisBlockIndex("redis://127.0.0.1:1/0", **kwargs)  # type: ignore[arg-type]
