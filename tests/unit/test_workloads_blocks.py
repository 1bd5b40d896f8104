"""Block ids from content segments: equal content and prefix give equal ids, nothing else does."""

from __future__ import annotations

import pytest

from bench.workloads.blocks import BlockIdAllocator, Segment


@pytest.mark.parametrize(
    ("first", "second", "shared"),
    [
        # Same 2-block system prompt, different tails: the two full blocks are shared.
        ([Segment("sys", 8), Segment("a", 3)], [Segment("sys", 8), Segment("b", 3)], 2),
        # A different first block breaks the whole chain, even with identical later content.
        ([Segment("x", 4), Segment("sys", 8)], [Segment("y", 4), Segment("sys", 8)], 0),
        # A block straddling the shared/unique boundary is not shared.
        ([Segment("sys", 6), Segment("a", 6)], [Segment("sys", 6), Segment("b", 6)], 1),
        # A partial last block differs from the full block that later extends it.
        ([Segment("sys", 6)], [Segment("sys", 6), Segment("more", 2)], 1),
    ],
)
def test_shared_prefix_length(first: list[Segment], second: list[Segment], shared: int) -> None:
    allocator = BlockIdAllocator(block_size=4)
    a, b = allocator.hash_ids(first), allocator.hash_ids(second)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert common == shared
    # Ids after the common prefix never collide between the two prompts.
    assert not set(a[common:]) & set(b[common:])


def test_one_id_per_block_including_a_partial_one() -> None:
    assert len(BlockIdAllocator(4).hash_ids([Segment("a", 9)])) == 3


@pytest.mark.parametrize("bad", [0, -4])
def test_bad_sizes_are_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockIdAllocator(bad)
    with pytest.raises(ValueError, match="must be >= 1"):
        Segment("a", bad)
