"""``EventApplier``: KV events -> index writes, epochs, and outage buffering (in-memory index)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from replica.agent import AgentMetrics, EventApplier, cache_salt_of
from replica.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, make_batch
from routing.contracts import IndexUnavailable
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import MemoryBlockIndex
from routing.types import BlockHash, Epoch, ReplicaId

R = ReplicaId("r0")
BS = 2
TOKENS = [5, 6, 7, 8, 9, 10]


def stored(
    hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    lora: str | None = None,
    lora_id: int | None = None,
    extra_keys: list[tuple[object, ...] | None] | None = None,
    group_idx: int | None = 0,
    medium: str | None = "GPU",
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
        lora_id=lora_id if lora_id is not None else (1 if lora else None), medium=medium,
        lora_name=lora, extra_keys=extra_keys, group_idx=group_idx,
    )


def chain(tokens: list[int], adapter: str | None = None, salt: str | None = None) -> list[int]:
    return hash_token_blocks(tokens, BS, chain_seed("m", adapter, salt))


class SwitchableIndex(MemoryBlockIndex):
    """An in-memory index that fails every call while ``down`` (a Redis outage stand-in)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise IndexUnavailable("index down (test)")

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        self._check()
        await super().set_epoch(replica, epoch)

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        self._check()
        await super().retire_epoch(replica, epoch)

    async def record(
        self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        self._check()
        await super().record(replica, epoch, blocks, ttl_s)

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        self._check()
        await super().remove(replica, epoch, blocks)


def make_applier(index: MemoryBlockIndex | None = None) -> tuple[EventApplier, MemoryBlockIndex]:
    idx = index or MemoryBlockIndex()
    counter = iter(range(1, 1000))
    applier = EventApplier(
        idx, R, AgentMetrics("r0"), model="m", epoch_source=lambda: Epoch(next(counter))
    )
    return applier, idx


async def apply(applier: EventApplier, *events: object) -> None:
    await applier.apply_batch(make_batch(list(events), ts=0.0))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (stored([1], [1, 2]), None),
        (stored([1], [1, 2], extra_keys=[None]), None),
        (stored([1], [1, 2], extra_keys=[("salt",)]), "salt"),
        (stored([1], [1, 2], lora="ad", extra_keys=[("ad",)]), None),
        (stored([1], [1, 2], lora="ad", extra_keys=[("ad", "salt")]), "salt"),
        # multimodal pairs come before the salt; embedding digests (bytes) after it
        (stored([1], [1, 2], extra_keys=[(["img", 0], "salt", b"\x01")]), "salt"),
        # a salt equal to the adapter name is still found after the adapter
        (stored([1], [1, 2], lora="x", extra_keys=[("x", "x")]), "x"),
    ],
)
def test_cache_salt_of(event: BlockStored, expected: str | None) -> None:
    assert cache_salt_of(event) == expected


async def test_root_and_child_events_build_one_chain() -> None:
    applier, index = make_applier()
    await applier.start()
    await apply(applier, stored([11, 12], TOKENS[:4]))
    await apply(applier, stored([13], TOKENS[4:], parent=12))
    assert await index.match(chain(TOKENS)) == {R: 3}
    await apply(applier, BlockRemoved(block_hashes=[12, 999], medium="GPU"))
    assert await index.match(chain(TOKENS)) == {R: 1}


async def test_adapter_and_salt_fold_into_the_seed() -> None:
    applier, index = make_applier()
    await applier.start()
    await apply(applier, stored([1, 2], TOKENS[:4], lora="ad", extra_keys=[("ad", "s"), ("ad",)]))
    assert await index.match(chain(TOKENS[:4], "ad", "s")) == {R: 2}
    assert await index.match(chain(TOKENS[:4])) == {}
    assert await index.match(chain(TOKENS[:4], "ad")) == {}


@pytest.mark.parametrize(
    "event",
    [
        stored([3], TOKENS[2:4], parent=404),  # parent never seen
        stored([3], TOKENS[:3]),  # 3 tokens for one block of 2
        stored([3], TOKENS[:2], lora_id=7),  # legacy adapter event without a name
        stored([3], TOKENS[:2], group_idx=1),  # another KV-cache group
        stored([3], TOKENS[:2], medium="CPU"),  # an offload tier
    ],
    ids=["unknown-parent", "bad-token-count", "adapter-without-name", "group-1", "cpu-medium"],
)
async def test_events_that_cannot_be_keyed_are_skipped(event: BlockStored) -> None:
    applier, index = make_applier()
    await applier.start()
    await apply(applier, event)
    assert (await index.stats()).entries == 0


async def test_cleared_retires_the_epoch_but_keeps_parents_resolvable() -> None:
    applier, index = make_applier()
    assert await applier.start() == 1
    await apply(applier, stored([1, 2], TOKENS[:4]))
    await apply(applier, AllBlocksCleared())
    assert applier.epoch == 2
    assert await index.match(chain(TOKENS)) == {}
    assert applier.metrics.value(
        "fleetgate_agent_epoch_retirements_total", reason="cleared"
    ) == 1
    # vLLM may store a child of a block computed before the reset: the hash still resolves.
    await apply(applier, stored([3], TOKENS[4:], parent=2))
    assert await index.match(chain(TOKENS)) == {}  # blocks 0-1 are gone, so no prefix match
    assert list(applier.hashes.live_blocks()) == chain(TOKENS)[2:]


async def test_outage_marks_dirty_and_resync_rerecords_only_live_blocks() -> None:
    index = SwitchableIndex()
    applier, _ = make_applier(index)
    await applier.start()
    await apply(applier, stored([1, 2], TOKENS[:4]))
    index.down = True
    await apply(applier, stored([3], TOKENS[4:], parent=2))
    await apply(applier, BlockRemoved(block_hashes=[1], medium="GPU"))
    assert applier.dirty
    assert applier.metrics.value("fleetgate_agent_redis_errors_total") == 1  # then writes skip
    assert not await applier.resync()  # still down
    index.down = False
    assert await applier.resync()
    assert not applier.dirty
    full = chain(TOKENS)
    assert await index.match(full) == {}  # block 0 was evicted during the outage
    # Blocks 1 and 2 are live and were re-recorded under the new epoch.
    assert set(applier.hashes.live_blocks()) == set(full[1:])
    assert await index.match(full[1:]) == {R: 2}
    assert applier.epoch is not None and applier.epoch > 1


async def test_epoch_listeners_hear_every_change() -> None:
    applier, _ = make_applier()
    heard: list[int] = []

    async def listener(epoch: Epoch) -> None:
        heard.append(epoch)

    applier.on_epoch_change(listener)
    await applier.start()
    await applier.new_epoch("gap")
    await applier.new_epoch("restart", forget_hashes=True)
    assert heard == [1, 2, 3]


async def test_stored_before_model_known_is_a_bug() -> None:
    applier, _ = make_applier()
    applier.model = None
    await applier.start()
    with pytest.raises(RuntimeError, match="model must be set"):
        await apply(applier, stored([1], TOKENS[:2]))
