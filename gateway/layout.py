"""Prefix-layout diagnostics: how much of each route's prompts repeat, and layouts that bust caches.

A prefix cache only reuses a block when every block before it matches too. A layout that puts
something unique first (a timestamp, a request id, the user's name) ahead of a long shared system
prompt defeats it: the shared blocks repeat *by content* across requests, yet their chained hashes
never match. The detector keeps two bounded sketches per route — chained hashes (what the cache
can reuse) and un-chained per-block content hashes (what repeats at all) — and flags a route when
a large share of blocks repeat by content *after* the chained prefix has already missed.

Content blocks have the chain's geometry: ``block_size`` tokens, or in text mode ``block_size *
CHARS_PER_TOKEN`` characters, so the i-th content hash covers exactly the i-th chain block.

It runs on the request path, so it is kept cheap: a few C-level set operations per request
(O(blocks)), running totals over the recent observations, and the full report (with its median)
computed only when asked for (``/metrics``, ``/admin/layout``). Past a route's first
``full_requests`` requests only one in ``sample_every`` is observed: the report is about the
recent few hundred observations anyway, and a layout shared by a meaningful share of the traffic
still repeats across the sampled requests.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from routing.contracts import TokenizedPrompt
from routing.hashing import CHARS_PER_TOKEN
from routing.types import BlockHash

log = logging.getLogger(__name__)

_ADVICE = (
    "Move per-request content (timestamps, ids, user data) after the shared part of the "
    "prompt so the shared blocks form a common prefix."
)


class BoundedSet:
    """A set that forgets its least recently added members beyond ``capacity``.

    Two generations of plain sets: members go into the young one; when it holds half the
    capacity it becomes the old one and the previous old one is dropped. A member seen again is
    re-added to the young generation, so what keeps repeating stays. Memory stays under
    ``capacity`` members, and every operation is C-level set work.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._half = max(1, capacity // 2)
        self._young: set[int] = set()
        self._old: set[int] = set()

    def __contains__(self, item: int) -> bool:
        return item in self._young or item in self._old

    def add(self, item: int) -> None:
        self.update((item,))

    def update(self, items: Iterable[int]) -> None:
        """Add every member of ``items``."""
        self._young.update(items)
        if len(self._young) >= self._half:
            self._old = self._young
            self._young = set()

    def count_known(self, items: Sequence[int]) -> int:
        """How many of ``items`` (duplicates counted) are members."""
        young, old = self._young, self._old
        return sum(1 for h in items if h in young or h in old)

    def prefix_known(self, items: Sequence[int]) -> int:
        """Length of the longest prefix of ``items`` whose members are all known."""
        young, old = self._young, self._old
        n = 0
        for h in items:
            if h not in young and h not in old:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._young | self._old)


def block_content_hashes(prompt: TokenizedPrompt, block_size: int, seed: int = 0) -> list[int]:
    """Un-chained hash of each full block's content alone (no parent), seeded with ``seed``.

    Blocks are cut as the chain cuts them (``routing.hashing.prompt_chain``): ``block_size``
    tokens, or ``block_size * CHARS_PER_TOKEN`` characters in text mode. Give the chain's seed
    (``routing.hashing.chain_seed``: model, adapter, tenant salt): a block repeats by content
    only within one cache domain, as it can only be reused within one.
    """
    if prompt.token_ids is not None:
        data = np.asarray(prompt.token_ids, dtype="<u4").tobytes()
        step = block_size * 4  # 4 bytes per token id
    else:
        data = (prompt.text or "").encode("utf-32-le", "surrogatepass")
        step = block_size * CHARS_PER_TOKEN * 4  # 4 bytes per character
    view = memoryview(data)
    digest = xxhash.xxh3_64_intdigest
    return [digest(view[i : i + step], seed) for i in range(0, len(data) - step + 1, step)]


@dataclass
class RouteLayout:
    """Sketches, recent observations and their running totals for one route.

    ``recent`` holds ``(blocks, prefix_repeat_blocks, content_repeat_after_miss, first_miss)``
    per observed request.
    """

    chained: BoundedSet
    content: BoundedSet
    recent: deque[tuple[int, int, int, int]]
    #: Requests seen on the route (observed or skipped by sampling).
    seen: int = 0
    blocks: int = 0
    prefix_repeat: int = 0
    after_miss: int = 0
    warned: bool = False
    detected: bool = False


@dataclass
class LayoutReport:
    """What the admin API shows for one route."""

    route: str
    requests: int
    prefix_repeat_fraction: float
    content_repeat_after_miss_fraction: float
    cache_busting_layout: bool
    median_first_miss_block: float | None
    advice: str | None = None
    extra: dict[str, float] = field(default_factory=dict)


class LayoutDiagnostics:
    """Per-route prefix-repeat fraction and cache-busting-layout detection."""

    def __init__(
        self,
        sketch_capacity: int = 32_768,
        recent_requests: int = 500,
        min_requests: int = 20,
        busting_threshold: float = 0.3,
        sample_every: int = 1,
        full_requests: int = 1_000,
    ) -> None:
        self.sample_every = max(1, sample_every)
        self.full_requests = full_requests
        self.sketch_capacity = sketch_capacity
        self.recent_requests = recent_requests
        self.min_requests = min_requests
        self.busting_threshold = busting_threshold
        self._routes: dict[str, RouteLayout] = {}

    def observe(
        self,
        route: str,
        prompt: TokenizedPrompt,
        chain: Sequence[BlockHash],
        block_size: int,
        seed: int = 0,
    ) -> None:
        """Account one request's prompt blocks, then remember them.

        ``seed``: the chain's seed (``routing.hashing.chain_seed`` of the model, adapter and
        tenant salt), so content repeats count only within one cache domain: two tenants with
        different salts sharing a template never share a cached block, and that is isolation,
        not a cache-busting layout. The default, 0, puts every request in one domain.
        """
        state = self._routes.get(route)
        if state is None:
            state = RouteLayout(
                BoundedSet(self.sketch_capacity),
                BoundedSet(self.sketch_capacity),
                deque(maxlen=self.recent_requests),
            )
            self._routes[route] = state
        state.seen += 1
        if state.seen > self.full_requests and state.seen % self.sample_every:
            return
        contents = block_content_hashes(prompt, block_size, seed)
        prefix = state.chained.prefix_known(chain)
        after_miss = state.content.count_known(contents[prefix:])
        recent = state.recent
        if len(recent) == recent.maxlen:
            old_blocks, old_prefix, old_after, _ = recent[0]
            state.blocks -= old_blocks
            state.prefix_repeat -= old_prefix
            state.after_miss -= old_after
        recent.append((len(chain), prefix, after_miss, prefix))
        state.blocks += len(chain)
        state.prefix_repeat += prefix
        state.after_miss += after_miss
        # Blocks of the chained prefix are known already; only the rest is news to the sketch.
        state.chained.update(chain[prefix:])
        state.content.update(contents)
        state.detected = self._busting(state)
        if state.detected and not state.warned:
            state.warned = True
            report = self._report(route, state)
            log.warning(
                "route %s: cache-busting prompt layout: %.0f%% of prompt blocks repeat by content "
                "after the shared prefix already diverged (median divergence at block %s). %s",
                route,
                report.content_repeat_after_miss_fraction * 100,
                report.median_first_miss_block,
                report.advice,
            )

    def _busting(self, state: RouteLayout) -> bool:
        if len(state.recent) < self.min_requests or not state.blocks:
            return False
        after = state.after_miss / state.blocks
        return after >= self.busting_threshold and state.after_miss > state.prefix_repeat

    def _report(self, route: str, state: RouteLayout) -> LayoutReport:
        blocks = state.blocks
        repeat = state.prefix_repeat / blocks if blocks else 0.0
        after = state.after_miss / blocks if blocks else 0.0
        busting = self._busting(state)
        misses = [first_miss for _b, _p, a, first_miss in state.recent if a]
        median = float(statistics.median(misses)) if misses else None
        advice = _ADVICE if busting else None
        return LayoutReport(route, len(state.recent), repeat, after, busting, median, advice)

    def reports(self) -> list[LayoutReport]:
        """One report per route seen."""
        return [self._report(route, state) for route, state in self._routes.items()]
