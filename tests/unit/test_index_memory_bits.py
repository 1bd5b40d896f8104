"""The in-memory index's incarnation bitmasks: exact against a plain model, bits recycled safely."""

from __future__ import annotations

import random

import pytest

from routing.index import MemoryBlockIndex
from routing.types import BlockHash, Epoch, ReplicaId


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ReferenceIndex:
    """The documented semantics, written as plainly as possible (no bound, no laziness)."""

    def __init__(self, require_heartbeat: bool) -> None:
        self.require_heartbeat = require_heartbeat
        self.epochs: dict[ReplicaId, Epoch | None] = {}
        self.deadlines: dict[ReplicaId, float] = {}
        #: block -> replica -> (epoch, expiry or None)
        self.blocks: dict[BlockHash, dict[ReplicaId, tuple[Epoch, float | None]]] = {}

    def record(self, replica, epoch, blocks, expires_at) -> None:
        if not blocks:
            return
        self.epochs.setdefault(replica, epoch)
        if self.epochs[replica] != epoch:
            return
        for block in blocks:
            holders = self.blocks.setdefault(block, {})
            held = holders.get(replica)
            if expires_at is not None and held == (epoch, None):
                continue
            holders[replica] = (epoch, expires_at)

    def remove(self, replica, epoch, blocks) -> None:
        for block in blocks:
            holders = self.blocks.get(block, {})
            if replica in holders and holders[replica][0] == epoch:
                del holders[replica]

    def matches(self, replica, block, now) -> bool:
        held = self.blocks.get(block, {}).get(replica)
        if held is None or self.epochs.get(replica) != held[0]:
            return False
        if held[1] is not None and held[1] <= now:
            return False
        deadline = self.deadlines.get(replica)
        return (not self.require_heartbeat) if deadline is None else deadline > now

    def match(self, chain, now) -> dict[ReplicaId, int]:
        depths = {}
        for replica in self.epochs:
            depth = 0
            while depth < len(chain) and self.matches(replica, chain[depth], now):
                depth += 1
            if depth:
                depths[replica] = depth
        return depths


@pytest.mark.parametrize("seed", range(12))
async def test_matches_agree_with_a_plain_model_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    require_heartbeat = seed % 3 == 0
    clock = FakeClock()
    # A small compaction threshold so bits are freed and reused many times during the run.
    index = MemoryBlockIndex(
        max_entries=10**6, clock=clock, require_heartbeat=require_heartbeat, compact_after_dead=2
    )
    model = ReferenceIndex(require_heartbeat)
    replicas = [ReplicaId(f"r{i}") for i in range(6)]
    next_epoch = {replica: 1 for replica in replicas}
    chains = [[BlockHash(1000 * c + b) for b in range(12)] for c in range(3)]
    chains.append(chains[0][:5] + [BlockHash(9000 + b) for b in range(6)])  # a shared prefix
    for _ in range(400):
        replica = rng.choice(replicas)
        chain = rng.choice(chains)
        op = rng.random()
        if op < 0.35:
            epoch = model.epochs.get(replica) or Epoch(next_epoch[replica])
            if rng.random() < 0.1:
                epoch = Epoch(epoch + 1000)  # a write for some other epoch: usually dropped
            start = rng.randrange(0, 3)
            blocks = chain[start : rng.randrange(start, len(chain) + 1)]
            ttl = rng.choice([None, None, 1.0, 5.0])
            await index.record(replica, epoch, blocks, ttl_s=ttl)
            model.record(replica, epoch, blocks, None if ttl is None else clock.now + ttl)
        elif op < 0.45:
            epoch = model.epochs.get(replica) or Epoch(1)
            blocks = rng.sample(chain, rng.randrange(1, 4))
            await index.remove(replica, epoch, blocks)
            model.remove(replica, epoch, blocks)
        elif op < 0.52:
            next_epoch[replica] += 1  # never reuse an epoch number
            await index.set_epoch(replica, Epoch(next_epoch[replica]))
            model.epochs[replica] = Epoch(next_epoch[replica])
        elif op < 0.58:
            live = model.epochs.get(replica)
            if live is not None:
                await index.retire_epoch(replica, live)
                model.epochs[replica] = None
                next_epoch[replica] += 1
        elif op < 0.66:
            ttl = rng.choice([0.5, 3.0, 30.0])
            await index.heartbeat(replica, ttl)
            model.deadlines[replica] = clock.now + ttl
        elif op < 0.74:
            clock.now += rng.choice([0.2, 1.0, 2.5])
        else:
            query = chain[: rng.randrange(0, len(chain) + 1)]
            assert await index.match(query) == model.match(query, clock.now)
    stats = await index.stats()
    assert stats.extra["compactions"] > 0
    for chain in chains:
        assert await index.match(chain) == model.match(chain, clock.now)


async def test_compaction_frees_dead_bits_and_a_recycled_bit_never_inherits_entries() -> None:
    index = MemoryBlockIndex(compact_after_dead=2)
    a, b = ReplicaId("a"), ReplicaId("b")
    chain = [BlockHash(v) for v in range(1, 6)]
    await index.set_epoch(a, Epoch(1))  # bit 0
    await index.set_epoch(b, Epoch(1))  # bit 1
    await index.record(a, Epoch(1), chain)
    await index.record(b, Epoch(1), chain[:2])
    await index.retire_epoch(a, Epoch(1))  # bit 0 dead, one dead bit: no compaction yet
    stats = await index.stats()
    assert (stats.extra["dead_incarnation_bits"], stats.extra["compactions"]) == (1, 0)
    assert await index.match(chain) == {b: 2}
    await index.set_epoch(b, Epoch(2))  # bit 1 dead too: compaction clears and frees both
    stats = await index.stats()
    assert stats.extra["compactions"] == 1
    assert (stats.extra["incarnation_bits"], stats.extra["dead_incarnation_bits"]) == (1, 0)
    assert stats.entries == 0  # every block held only dead entries
    # b's new epoch took a recycled bit; a's next epoch takes the other: neither sees old entries.
    await index.set_epoch(a, Epoch(2))
    assert await index.match(chain) == {}
    await index.record(a, Epoch(2), chain[:1])
    assert await index.match(chain) == {a: 1}
    assert (await index.stats()).extra["incarnation_bits"] == 2


async def test_retired_incarnations_never_match_again_across_many_restarts() -> None:
    index = MemoryBlockIndex(compact_after_dead=3)
    chain = [BlockHash(v) for v in range(10, 20)]
    replicas = [ReplicaId(f"r{i}") for i in range(4)]
    for generation in range(1, 30):
        for position, replica in enumerate(replicas):
            await index.set_epoch(replica, Epoch(generation))
            # Each incarnation holds a different prefix length; the old ones hold longer ones.
            await index.record(replica, Epoch(generation), chain[: 1 + (generation + position) % 9])
        expected = {r: 1 + (generation + p) % 9 for p, r in enumerate(replicas)}
        assert await index.match(chain) == expected
        # Late writes of the previous incarnations are dropped, whatever bit they once had.
        for replica in replicas:
            await index.record(replica, Epoch(generation - 1), chain)
        assert await index.match(chain) == expected
    stats = await index.stats()
    # Masks stay narrow: live bits plus fewer than compact_after_dead dead ones.
    assert stats.extra["incarnation_bits"] < len(replicas) + 3
    assert stats.extra["compactions"] > 0


async def test_the_lru_bound_holds_with_many_replicas_and_speculative_entries() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(max_entries=50, clock=clock)
    for i in range(40):
        replica = ReplicaId(f"r{i % 7}")
        blocks = [BlockHash(1000 * i + b) for b in range(9)]
        await index.record(replica, Epoch(1), blocks, ttl_s=None if i % 2 else 3.0)
        assert (await index.stats()).entries <= 50
    stats = await index.stats()
    assert stats.entries == 50
    assert stats.extra["evictions"] == 40 * 9 - 50
    newest = [BlockHash(1000 * 39 + b) for b in range(9)]
    assert await index.match(newest) == {ReplicaId("r4"): 9}


async def test_a_speculative_guess_of_the_live_epoch_replaces_an_old_incarnations_entry() -> None:
    clock = FakeClock()
    index = MemoryBlockIndex(clock=clock)
    r = ReplicaId("r")
    chain = [BlockHash(v) for v in range(3)]
    await index.record(r, Epoch(1), chain)
    await index.set_epoch(r, Epoch(2))
    await index.record(r, Epoch(2), chain, ttl_s=1.0)
    assert await index.match(chain) == {r: 3}
    clock.now += 1.0
    assert await index.match(chain) == {}
    assert (await index.stats()).entries == 0  # the expired guesses were reclaimed


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_compact_after_dead_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ValueError, match="compact_after_dead must be a positive integer"):
        MemoryBlockIndex(compact_after_dead=value)  # type: ignore[arg-type]
