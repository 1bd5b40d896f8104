"""The speculative index write: a held prefix is rewritten twice per TTL, new blocks always."""

from __future__ import annotations

from gateway.speculative import SpeculativeWriter
from routing.index.memory import MemoryBlockIndex
from routing.types import BlockHash, Epoch, ReplicaId

R0, R1 = ReplicaId("r0"), ReplicaId("r1")
TTL = 30.0
SHARED = [BlockHash(i) for i in range(1, 81)]  # a system prompt, 80 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _prompt(n: int) -> list[BlockHash]:
    return SHARED + [BlockHash(10_000 * n + i) for i in range(20)]  # + a fresh user turn


def test_nothing_held_means_the_whole_chain() -> None:
    writer = SpeculativeWriter(Clock())
    chain = _prompt(1)
    assert writer.blocks_to_write(R0, chain, 0, TTL) == chain


def test_a_held_prefix_is_written_once_then_only_the_new_blocks() -> None:
    clock = Clock()
    writer = SpeculativeWriter(clock)
    # First time the replica is seen holding the shared prefix: a full write, remembered.
    assert writer.blocks_to_write(R0, _prompt(1), 80, TTL) == _prompt(1)
    clock.now += 1
    assert writer.blocks_to_write(R0, _prompt(2), 80, TTL) == _prompt(2)[80:]
    assert (writer.full_writes, writer.partial_writes) == (1, 1)
    # Another replica holding the same prefix was not written by that full write.
    assert writer.blocks_to_write(R1, _prompt(3), 80, TTL) == _prompt(3)


def test_the_prefix_is_rewritten_after_half_the_ttl() -> None:
    clock = Clock()
    writer = SpeculativeWriter(clock)
    writer.blocks_to_write(R0, _prompt(1), 80, TTL)
    clock.now += TTL / 2 - 0.01
    assert len(writer.blocks_to_write(R0, _prompt(2), 80, TTL)) == 20
    clock.now += 0.02
    assert len(writer.blocks_to_write(R0, _prompt(3), 80, TTL)) == 100


def test_a_fully_held_chain_needs_no_write_while_fresh() -> None:
    clock = Clock()
    writer = SpeculativeWriter(clock)
    chain = _prompt(1)
    assert writer.blocks_to_write(R0, chain, len(chain), TTL) == chain
    assert list(writer.blocks_to_write(R0, chain, len(chain), TTL)) == []
    assert writer.skipped_writes == 1


async def test_a_hot_prefix_never_expires_in_the_index_under_partial_writes() -> None:
    """Index and writer together, one request every second for three TTLs."""
    clock = Clock()
    index = MemoryBlockIndex(clock=clock)
    writer = SpeculativeWriter(clock)
    await index.set_epoch(R0, Epoch(1))
    written = 0
    for n in range(int(3 * TTL)):
        chain = _prompt(n)
        depth = (await index.match(chain)).get(R0, 0)
        if n > 0:
            assert depth == 80, f"request {n}: the shared prefix must still be held"
        blocks = writer.blocks_to_write(R0, chain, depth, TTL)
        written += len(blocks)
        await index.record(R0, Epoch(1), list(blocks), ttl_s=TTL)
        clock.now += 1.0
    # About two full writes per TTL instead of one per request.
    assert written < 0.35 * 100 * int(3 * TTL)
    assert writer.full_writes <= 2 + 3 * 2
