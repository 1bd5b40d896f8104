"""The speculative index write: a held prefix is rewritten twice per TTL, new blocks always."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gateway.speculative import SpeculativeTarget, SpeculativeWriter, done, in_process_record
from routing.index.memory import MemoryBlockIndex
from routing.state import ReplicaState
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


# --------------------------------------------------------------------------- where writes go


class CountingMemoryIndex(MemoryBlockIndex):
    """Overrides the async ``record``, as tests do: writes must go through it."""

    def __init__(self) -> None:
        super().__init__()
        self.async_writes = 0

    async def record(self, *args: Any, **kwargs: Any) -> None:
        self.async_writes += 1
        await super().record(*args, **kwargs)


class OnlyAsyncIndex:
    async def record(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_only_an_index_whose_own_record_never_waits_is_written_in_process() -> None:
    memory = MemoryBlockIndex()
    assert in_process_record(memory) is memory
    assert in_process_record(CountingMemoryIndex()) is None  # its record must see the write
    assert in_process_record(OnlyAsyncIndex()) is None


def _target(index: MemoryBlockIndex, background: set[asyncio.Task[Any]]) -> SpeculativeTarget:
    replica = ReplicaState(replica_id=R0, url="http://r0", epoch=Epoch(1))
    return SpeculativeTarget(
        index=index,
        replicas=SimpleNamespace(get=lambda rid: replica if rid == R0 else None),
        ttl_s=TTL,
        count_error=lambda: None,
        background=background,
        in_process=in_process_record(index),
    )


async def test_an_in_process_write_is_a_callback_and_any_other_a_task() -> None:
    background: set[asyncio.Task[Any]] = set()
    memory = MemoryBlockIndex()
    assert SpeculativeWriter(Clock()).start(_target(memory, background), R0, SHARED, 0) is None
    await asyncio.sleep(0)  # one loop turn: the callback has run
    assert await memory.match(SHARED) == {R0: len(SHARED)}

    counting = CountingMemoryIndex()
    task = SpeculativeWriter(Clock()).start(_target(counting, background), R0, SHARED, 0)
    assert task is not None and task in background
    await done(task)
    assert counting.async_writes == 1
    assert await counting.match(SHARED) == {R0: len(SHARED)}


class _Late(MemoryBlockIndex):
    """Answers only once released: a write that outlasts its budget (no clock read)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def record(self, *args: Any, **kwargs: Any) -> None:
        await self.release.wait()


class _Down(MemoryBlockIndex):
    async def record(self, *args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Redis is down")


async def test_a_late_write_is_counted_slow_and_a_failed_one_an_index_error() -> None:
    """The load review: a burst's writes that outlasted their 50 ms budget counted as index
    errors, whose alert pages "Redis unavailable" with Redis healthy."""
    counts = {"error": 0, "slow": 0}

    def target(index: MemoryBlockIndex) -> SpeculativeTarget:
        replica = ReplicaState(replica_id=R0, url="http://r0", epoch=Epoch(1))
        return SpeculativeTarget(
            index=index,
            replicas=SimpleNamespace(get=lambda rid: replica if rid == R0 else None),
            ttl_s=TTL,
            count_error=lambda: counts.__setitem__("error", counts["error"] + 1),
            background=set(),
            count_slow=lambda: counts.__setitem__("slow", counts["slow"] + 1),
        )

    late = _Late()
    await done(SpeculativeWriter(Clock()).start(target(late), R0, SHARED, 0))
    late.release.set()
    assert counts == {"error": 0, "slow": 1}
    await done(SpeculativeWriter(Clock()).start(target(_Down()), R0, SHARED, 0))
    assert counts == {"error": 1, "slow": 1}
