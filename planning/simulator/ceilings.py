"""Prefix hit-rate ceilings: what no routing policy can beat on a trace.

* ``unbounded``: every request on one replica whose cache never evicts. A block hits if the same
  chain block was seen before (by an earlier request). This is the trace's own reuse.
* ``pooled``: every request on one replica whose cache is as large as the whole fleet's KV
  capacity, evicting least-recently-used blocks. A perfect router over N replicas with no
  duplicated blocks and no load limits would reach it; real fleets duplicate hot prefixes and
  must balance load, so they land below.

Both count hits as the engine model does: in whole engine blocks, never the prompt's last token
(the engine recomputes it to get logits), and never across adapters. They ignore timing: a
request that arrives while its prefix is still being prefilled elsewhere still counts as a hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from traces.format import TraceRecord

__all__ = ["Ceilings", "hit_rate_ceilings"]

#: Trace ids are arbitrary JSON integers; they are folded to 64 bits before hashing.
_U64 = 2**64 - 1


@dataclass(frozen=True)
class Ceilings:
    """Hit-rate ceilings of one trace (cached prompt tokens / prompt tokens)."""

    unbounded: float
    pooled: float
    #: Capacity of the pooled cache, in tokens.
    pooled_capacity_tokens: int


def _block_keys(record: TraceRecord) -> list[int]:
    """One key per trace block (partial last block included), chained so a key names a prefix."""
    parent = xxhash.xxh3_64_intdigest((record.adapter or "").encode())
    keys = []
    for hash_id in record.hash_ids:
        parent = xxhash.xxh3_64_intdigest((hash_id & _U64).to_bytes(8, "little"), parent)
        keys.append(parent)
    return keys


def _block_lengths(record: TraceRecord, trace_block_size: int) -> list[int]:
    """Tokens of each trace block of the prompt (the last may be partial)."""
    length = record.input_length
    return [
        min(trace_block_size, length - j * trace_block_size) for j in range(len(record.hash_ids))
    ]


def _hit_tokens(
    seen: dict[int, int] | OrderedDict[int, int],
    keys: list[int],
    lengths: list[int],
    input_length: int,
    engine_block_size: int,
) -> int:
    """Cached tokens of one prompt given ``seen`` (chain key -> tokens of it held)."""
    cached = 0
    for key, length in zip(keys, lengths, strict=True):
        held = seen.get(key, 0)
        if held >= length:
            cached += length
            continue
        cached += held  # a shorter copy of the same block (an earlier partial last block)
        break
    usable = (input_length - 1) // engine_block_size * engine_block_size
    return min(cached // engine_block_size * engine_block_size, usable)


def hit_rate_ceilings(
    records: Iterable[TraceRecord],
    trace_block_size: int,
    engine_block_size: int,
    pooled_capacity_tokens: int,
) -> Ceilings:
    """The ``unbounded`` and ``pooled`` ceilings of a trace, in arrival order."""
    if pooled_capacity_tokens < 1:
        raise ValueError(f"pooled_capacity_tokens must be >= 1 (got {pooled_capacity_tokens})")
    unbounded: dict[int, int] = {}
    pooled: OrderedDict[int, int] = OrderedDict()
    pooled_tokens = 0
    prompt_tokens = unbounded_hits = pooled_hits = 0
    for record in records:
        keys = _block_keys(record)
        lengths = _block_lengths(record, trace_block_size)
        prompt_tokens += record.input_length
        unbounded_hits += _hit_tokens(
            unbounded, keys, lengths, record.input_length, engine_block_size
        )
        pooled_hits += _hit_tokens(pooled, keys, lengths, record.input_length, engine_block_size)
        for key, length in zip(keys, lengths, strict=True):
            if unbounded.get(key, 0) < length:
                unbounded[key] = length
        # Touch tail first, as an engine frees a request's blocks: the shared prefix ends up
        # most recently used and outlives the request's private suffix.
        for key, length in zip(reversed(keys), reversed(lengths), strict=True):
            stored = length // engine_block_size * engine_block_size
            held = pooled.get(key)
            if held is None:
                pooled[key] = stored
                pooled_tokens += stored
            else:
                pooled.move_to_end(key)
                if stored > held:
                    pooled[key] = stored
                    pooled_tokens += stored - held
        while pooled_tokens > pooled_capacity_tokens and pooled:
            _, evicted = pooled.popitem(last=False)
            pooled_tokens -= evicted
    if prompt_tokens == 0:
        return Ceilings(0.0, 0.0, pooled_capacity_tokens)
    return Ceilings(
        unbounded=unbounded_hits / prompt_tokens,
        pooled=pooled_hits / prompt_tokens,
        pooled_capacity_tokens=pooled_capacity_tokens,
    )
