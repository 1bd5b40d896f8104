"""The simulated KV cache: exact block ids, sharing, LRU eviction and the events it emits."""

from __future__ import annotations

import pytest
import xxhash

from replica.sim.kv_cache import KVCache, chain_seed, extend_chain, token_bytes

BS = 2


def tokens_of(start: int, stop: int) -> list[int]:
    """A fixed token source: token i is 100 + i."""
    return list(range(100 + start, 100 + stop))


def store(cache: KVCache, rid: str, hashes: list[int]) -> None:
    """Allocate and cache ``len(hashes)`` full blocks for ``rid``."""
    assert cache.allocate(rid, len(hashes) * BS)
    cache.cache_full_blocks(rid, hashes, len(hashes), tokens_of, None)


def test_chain_hash_is_xxh3_seeded_by_parent() -> None:
    seed = chain_seed(None, None)
    data = token_bytes([1, 2, 3, 4])
    hashes: list[int] = []
    extend_chain(hashes, data, BS, 2, seed)
    first = xxhash.xxh3_64_intdigest(token_bytes([1, 2]), seed)
    assert hashes == [first, xxhash.xxh3_64_intdigest(token_bytes([3, 4]), first)]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((None, None), ("lora-a", None)),
        ((None, None), (None, "tenant-1")),
        (("lora-a", "tenant-1"), ("lora-a", "tenant-2")),
        (("lora-a", None), ("lora-b", None)),
        ((None, ""), ("", None)),
    ],
)
def test_chain_seed_separates_adapters_and_salts(a: tuple, b: tuple) -> None:
    assert chain_seed(*a) != chain_seed(*b)
    assert chain_seed(*a) == chain_seed(*a)


def test_allocation_takes_lowest_free_blocks_and_stores_events() -> None:
    cache = KVCache(num_blocks=4, block_size=BS)
    store(cache, "a", [11, 12])
    assert cache.blocks_of("a") == [0, 1]
    (event,) = cache.take_events()
    assert (event.kind, event.block_hashes, event.parent_block_hash) == (
        "BlockStored",
        [11, 12],
        None,
    )
    assert event.token_ids == [100, 101, 102, 103]
    assert cache.usage == pytest.approx(0.5)


def test_freed_blocks_are_evicted_least_recently_freed_first_tail_first() -> None:
    cache = KVCache(num_blocks=4, block_size=BS)
    store(cache, "a", [11, 12])  # blocks 0, 1
    store(cache, "b", [21, 22])  # blocks 2, 3
    cache.free("a")  # free queue: 1, 0 (tail first)
    cache.free("b")  # free queue: 1, 0, 3, 2
    cache.take_events()
    assert cache.usage == 0.0
    assert cache.num_cached_blocks == 4  # not in use, still cached (usage misses them)
    evicted: list[int] = []
    for rid in ("c", "d", "e", "f"):
        assert cache.allocate(rid, 1)
        (event,) = cache.take_events()
        assert event.kind == "BlockRemoved"
        evicted += event.block_hashes
    assert evicted == [12, 11, 22, 21]
    assert cache.num_cached_blocks == 0
    assert [cache.blocks_of(r) for r in "cdef"] == [[1], [0], [3], [2]]


def test_prefix_hit_shares_blocks_and_protects_them_from_eviction() -> None:
    cache = KVCache(num_blocks=4, block_size=BS)
    store(cache, "a", [11, 12])
    cache.free("a")
    cache.take_events()
    hits = cache.lookup([11, 12, 13])
    assert hits == [0, 1]
    # Hit blocks leave the free queue: 4 blocks for 8 tokens = 2 shared + 2 new.
    assert cache.allocate("b", 8, hits)
    assert cache.blocks_of("b") == [0, 1, 2, 3]
    assert cache.take_events() == []  # nothing evicted
    assert not cache.allocate("c", 1)  # all four held


def test_allocation_fails_without_side_effects() -> None:
    cache = KVCache(num_blocks=3, block_size=BS)
    store(cache, "a", [11])
    cache.free("a")
    cache.take_events()
    assert not cache.allocate("b", 8)  # needs 4 blocks, 3 exist
    assert cache.num_free_blocks == 3
    assert cache.is_cached(11)
    assert cache.blocks_of("b") == []


def test_duplicate_blocks_are_not_cached_twice() -> None:
    cache = KVCache(num_blocks=4, block_size=BS)
    store(cache, "a", [11])
    store(cache, "b", [11])  # computed the same block concurrently
    events = cache.take_events()
    assert [e.block_hashes for e in events] == [[11]]
    cache.free("a")
    cache.free("b")
    assert cache.lookup([11]) == [0]


def test_stored_run_carries_parent_hash_of_the_block_before() -> None:
    cache = KVCache(num_blocks=4, block_size=BS)
    assert cache.allocate("a", 6)
    cache.cache_full_blocks("a", [11, 12, 13], 1, tokens_of, "lora")
    cache.cache_full_blocks("a", [11, 12, 13], 3, tokens_of, "lora")
    first, second = cache.take_events()
    assert (first.block_hashes, first.parent_block_hash) == ([11], None)
    assert (second.block_hashes, second.parent_block_hash) == ([12, 13], 11)
    assert second.token_ids == [102, 103, 104, 105]
    assert second.lora_name == "lora"


def test_reset_clears_only_when_idle() -> None:
    cache = KVCache(num_blocks=4, block_size=BS)
    store(cache, "a", [11])
    assert not cache.reset()
    cache.free("a")
    cache.take_events()
    assert cache.reset()
    assert [e.kind for e in cache.take_events()] == ["AllBlocksCleared"]
    assert cache.lookup([11]) == []


def test_prefix_caching_off_never_hits_or_stores() -> None:
    cache = KVCache(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    store(cache, "a", [11])
    cache.free("a")
    assert cache.lookup([11]) == []
    assert cache.take_events() == []
