"""Generate a trace: a shape (what requests contain) × an arrival process (when they come)."""

from __future__ import annotations

import random

from bench.workloads.arrivals import BurstParams, arrivals
from bench.workloads.blocks import BlockIdAllocator, prompt_length
from bench.workloads.shapes import SHAPES
from traces.format import DEFAULT_BLOCK_SIZE, TraceRecord


def generate(
    shape: str,
    requests: int,
    rate: float,
    arrival: str = "poisson",
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    burst: BurstParams | None = None,
) -> list[TraceRecord]:
    """A deterministic trace of ``requests`` records of ``shape`` arriving at ``rate`` req/s.

    The same arguments always give the same trace. Content and arrival times come from separate
    random streams, so switching ``arrival`` changes only the timestamps, not the prompts.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from: {', '.join(SHAPES)}")
    # String seeds are hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
    times = arrivals(arrival, requests, rate, random.Random(f"{seed}:arrivals"), burst)
    source = SHAPES[shape](random.Random(f"{seed}:content"))
    allocator = BlockIdAllocator(block_size)
    records = []
    for arrival_s in times:
        request = source.next_request()
        records.append(
            TraceRecord(
                timestamp=round(arrival_s * 1000),
                input_length=prompt_length(request.segments),
                output_length=request.output_length,
                hash_ids=tuple(allocator.hash_ids(request.segments)),
                adapter=request.adapter,
            )
        )
    return records
