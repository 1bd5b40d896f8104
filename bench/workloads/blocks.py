"""Turn a prompt described as content segments into a prefix chain of block hash ids.

A prompt is a list of ``Segment``s (system prompt, retrieved document, user turn, …). Two
segments with the same ``key`` hold the same text, so requests that start with the same
segments share blocks. A block's id is determined by its parent's id and the exact slices of
segments it covers, so:

- equal ids mean equal content and equal prefix (the chain property of the trace format);
- a partial last block never shares an id with the full block that later extends it, matching
  an engine that only caches full blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` tokens of content named by ``key`` (equal keys mean equal text)."""

    key: Hashable
    length: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"segment {self.key!r}: length must be >= 1 (got {self.length})")


#: What one block holds: (segment key, start, end) slices, in prompt order.
_BlockContent = tuple[tuple[Hashable, int, int], ...]


class BlockIdAllocator:
    """Hands out hash ids, reusing an id whenever (parent id, block content) was seen before.

    One allocator must be used for a whole trace; ids start at 0 and grow by one, so traces stay
    compact and ids from different traces are not comparable (as in Mooncake traces).
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        self.block_size = block_size
        self._ids: dict[tuple[int | None, _BlockContent], int] = {}

    def hash_ids(self, segments: Sequence[Segment]) -> list[int]:
        """The prefix chain of ids for a prompt made of ``segments`` in order."""
        ids: list[int] = []
        parent: int | None = None
        current: list[tuple[Hashable, int, int]] = []
        room = self.block_size
        for segment in segments:
            offset = 0
            while offset < segment.length:
                take = min(room, segment.length - offset)
                current.append((segment.key, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._id_for(parent, tuple(current))
                    ids.append(parent)
                    current, room = [], self.block_size
        if current:
            ids.append(self._id_for(parent, tuple(current)))
        return ids

    def _id_for(self, parent: int | None, content: _BlockContent) -> int:
        key = (parent, content)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found


def prompt_length(segments: Sequence[Segment]) -> int:
    """Total tokens of a prompt."""
    return sum(segment.length for segment in segments)
