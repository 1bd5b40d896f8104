"""Micro-benchmark of issue 16's two reshaped structures alone: ``ExplanationMap`` and the
``MemoryBlockIndex`` records (docs/benchmarks/routing-decision.md).

Run it on each tree, alternately, from that tree's root::

    PYTHONPATH=. /work/main/.venv/bin/python docs/benchmarks/request-path/structures_micro.py

It reaches into private parts (``_Stages``, ``_spec``) on purpose: it times them alone.
"""

from __future__ import annotations

import gc
import random
import time
import timeit
from collections.abc import Callable

import routing.engine as engine
from routing.index.memory import MemoryBlockIndex
from routing.types import ReplicaId

REPLICAS = 64
SYSTEM_BLOCKS, USER_BLOCKS = 250, 125  # a 6,000-token prompt in 16-token blocks


def best_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def explanation_rows(rids: list[ReplicaId]) -> list[tuple[str, float]]:
    stages = engine._Stages()
    stages.totals = {r: 0.5 for r in rids[:-4]}
    stages.filtered_out_by = {r: "serves-model" for r in rids[-4:]}
    stages.matches = {r: i for i, r in enumerate(rids[:20])}
    stages.scorers = [
        ("prefix", {r: 0.3 for r in rids}, {r: {"matched_blocks": 3.0} for r in rids}),
        ("ttft", {r: 0.6 for r in rids}, {r: {"prefill_ms": 20.0, "queue_ms": 5.0} for r in rids}),
    ]
    stages.picker_terms = {r: {"rank": 1.0} for r in rids}
    loads = {r: float(i % 5) for i, r in enumerate(rids)}
    lazy = getattr(engine.ExplanationMap, "_lazy", None)  # the dict subclass (before)
    make = engine.ExplanationMap if lazy is None else lazy
    chosen = rids[3]

    def build_get() -> object:
        return make(dict(loads), stages).get(chosen)

    def build_len_in() -> object:
        explanations = make(dict(loads), stages)
        return len(explanations), chosen in explanations

    def build_items() -> object:
        return [e.matched_blocks for _, e in make(dict(loads), stages).items()]

    return [
        ("explanations: build + get(chosen) [us]", best_us(build_get, 20_000)),
        ("explanations: build + len + in [us]", best_us(build_len_in, 20_000)),
        ("explanations: build + items(), all 64 [us]", best_us(build_items, 2_000)),
    ]


def index_rows(rids: list[ReplicaId]) -> list[tuple[str, float]]:
    rng = random.Random(1)
    clock = [0.0]
    index = MemoryBlockIndex(1_000_000, clock=lambda: clock[0])
    systems = [[rng.getrandbits(63) for _ in range(SYSTEM_BLOCKS)] for _ in range(20)]

    def chain(system: list[int]) -> list[int]:
        return system + [rng.getrandbits(63) for _ in range(USER_BLOCKS)]

    for _ in range(1_000):
        blocks = chain(rng.choice(systems))
        for replica in rng.sample(rids, rng.randint(1, 3)):
            index.record_now(replica, 1, blocks)
    probe = chain(systems[0])
    confirmed = chain(systems[1])
    written = [0]

    def speculative() -> None:
        written[0] += 1
        clock[0] += 0.001
        n = written[0]
        index.record_now(rids[n % REPLICAS], 1, chain(systems[n % 20]), ttl_s=30.0)

    def full_collection_after_a_write_ms() -> float:
        speculative()
        started = time.perf_counter()
        gc.collect()
        return (time.perf_counter() - started) * 1e3

    rows = [
        (
            "index: match_now, 375-block chain, confirmed [us]",
            best_us(lambda: index.match_now(probe), 2_000),
        ),
        (
            "index: record_now confirmed, 375 blocks [us]",
            best_us(lambda: index.record_now(rids[5], 1, confirmed), 2_000),
        ),
        ("index: record_now speculative (ttl 30 s), 375 blocks [us]", best_us(speculative, 500)),
        (
            "index: match_now, 375-block chain, with guesses [us]",
            best_us(lambda: index.match_now(probe), 2_000),
        ),
    ]
    gc.collect()
    gc.collect()
    rows.append(("gc: tracked objects (whole process)", float(len(gc.get_objects()))))
    rows.append(
        (
            "gc: full collection after one speculative write [ms]",
            min(full_collection_after_a_write_ms() for _ in range(7)),
        )
    )
    return rows


def main() -> None:
    print("routing from", engine.__file__)
    rids = [ReplicaId(f"r{i}") for i in range(REPLICAS)]
    for name, value in explanation_rows(rids) + index_rows(rids):
        print(f"{name}\t{value:.3f}")


if __name__ == "__main__":
    main()
