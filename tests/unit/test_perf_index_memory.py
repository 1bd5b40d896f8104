"""The in-memory index's shared speculative states and fast block check keep exact semantics.

The behaviour suite (``tests/integration/test_index_behaviour.py``) and the plain-model test
(``test_index_memory_bits.py``) cover the semantics; these cases aim at what the speed-ups
could get wrong: one state object shared by many blocks, guesses of different replicas expiring
at different times inside one shared state, and argument errors raised as before.
"""

from __future__ import annotations

import enum

import pytest

from routing.index import MemoryBlockIndex
from routing.index._validate import check_blocks
from routing.index.memory import _checked_blocks
from routing.types import BlockHash, Epoch, ReplicaId

R1, R2, R3 = ReplicaId("r1"), ReplicaId("r2"), ReplicaId("r3")
E1, E2 = Epoch(1), Epoch(2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def chain(start: int, length: int) -> list[BlockHash]:
    return [BlockHash(start + b) for b in range(length)]


async def test_blocks_written_by_the_same_writes_share_one_state() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    shared = chain(100, 50)
    await index.record(R1, E1, shared, ttl_s=5.0)
    await index.record(R2, E1, shared[:30], ttl_s=5.0)
    states = {id(index._spec[b]) for b in shared}
    assert len(states) == 2  # blocks 0-29 (both guesses) and 30-49 (R1's only)
    assert await index.match(shared) == {R1: 50, R2: 30}


async def test_guesses_in_one_shared_state_expire_each_at_its_own_time() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    blocks = chain(1, 40)
    await index.record(R1, E1, blocks, ttl_s=1.0)
    clock.now += 0.5
    await index.record(R2, E1, blocks, ttl_s=1.0)
    await index.record(R3, E1, blocks[:10])  # confirmed: outlives every guess
    assert await index.match(blocks) == {R1: 40, R2: 40, R3: 10}
    clock.now += 0.6  # R1's guesses expired, R2's not
    assert await index.match(blocks) == {R2: 40, R3: 10}
    await index.record(R1, E1, blocks[:20], ttl_s=1.0)  # R1 guesses again, on half the chain
    assert await index.match(blocks) == {R1: 20, R2: 40, R3: 10}
    clock.now += 0.5  # R2's expired too
    assert await index.match(blocks) == {R1: 20, R3: 10}
    clock.now += 1.0
    assert await index.match(blocks) == {R3: 10}
    assert (await index.stats()).extra["speculative_blocks"] == 0


async def test_expiry_is_exact_at_the_earliest_guess_of_a_shared_state() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    blocks = chain(1, 8)
    await index.record(R1, E1, blocks, ttl_s=2.0)
    await index.record(R2, E1, blocks, ttl_s=1.0)
    clock.now += 1.0  # R2's guesses expire exactly now (an expiry is exclusive)
    assert await index.match(blocks) == {R1: 8}
    clock.now += 0.999
    assert await index.match(blocks) == {R1: 8}
    clock.now += 0.001
    assert await index.match(blocks) == {}


async def test_a_new_epoch_hides_a_shared_state_at_once_and_compaction_drops_it() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock, compact_after_dead=1)
    blocks = chain(1, 12)
    await index.record(R1, E1, blocks, ttl_s=60.0)
    await index.record(R2, E1, blocks, ttl_s=60.0)
    await index.set_epoch(R1, E2)  # compacts at once: R1's epoch-1 guesses go
    assert await index.match(blocks) == {R2: 12}
    assert all(len(index._spec[b][2]) == 1 for b in blocks)
    await index.record(R1, E2, blocks[:4], ttl_s=60.0)
    assert await index.match(blocks) == {R1: 4, R2: 12}


async def test_remove_and_confirmed_writes_take_out_one_replicas_guess_from_a_shared_state() -> (
    None
):
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    blocks = chain(1, 10)
    await index.record(R1, E1, blocks, ttl_s=5.0)
    await index.record(R2, E1, blocks, ttl_s=5.0)
    await index.remove(R1, E1, blocks[5:])
    assert await index.match(blocks) == {R1: 5, R2: 10}
    await index.record(R2, E1, blocks[:3])  # confirmed: replaces R2's guesses there
    clock.now += 5.0  # every guess expired; R2's confirmed blocks stay
    assert await index.match(blocks) == {R2: 3}
    await index.remove(R2, E1, blocks)
    assert await index.match(blocks) == {}
    assert (await index.stats()).entries == 0


async def test_a_guess_never_downgrades_a_confirmed_block_inside_a_shared_run() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    blocks = chain(1, 10)
    await index.record(R1, E1, blocks[3:6])  # confirmed in the middle of the run
    await index.record(R1, E1, blocks, ttl_s=1.0)
    clock.now += 1.0
    assert await index.match(blocks) == {}  # block 0 was only guessed
    assert await index.match(blocks[3:]) == {R1: 3}


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "blocks",
    [
        [1, 2, True],
        [1, -1],
        [0, 2**64],
        [1, 2.0],
        (3, "4"),
        [None],
        [2**64 - 1, 2**70],
    ],
)
def test_the_fast_block_check_raises_exactly_what_check_blocks_raises(blocks: list) -> None:
    with pytest.raises(ValueError) as expected:
        check_blocks(blocks)
    with pytest.raises(ValueError) as got:
        _checked_blocks(blocks)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize(
    "blocks", [[], (), [0, 2**64 - 1], (5,), [Color.RED, 2], range(3), [1, 2][::-1]]
)
def test_the_fast_block_check_accepts_what_check_blocks_accepts(blocks: object) -> None:
    check_blocks(blocks)  # type: ignore[arg-type]
    _checked_blocks(blocks)  # type: ignore[arg-type]


async def test_bad_blocks_are_refused_by_record_and_remove_alike() -> None:
    index = MemoryBlockIndex()
    for call in (
        index.record(R1, E1, [BlockHash(1), -5], ttl_s=1.0),  # type: ignore[list-item]
        index.remove(R1, E1, [BlockHash(1), -5]),  # type: ignore[list-item]
    ):
        with pytest.raises(ValueError, match=r"blocks\[1\] must be a block hash"):
            await call
    assert (await index.stats()).entries == 0
