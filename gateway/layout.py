"""Prefix-layout diagnostics: how much of each route's prompts repeat, and layouts that bust caches.

A prefix cache only reuses a block when every block before it matches too. A layout that puts
something unique first (a timestamp, a request id, the user's name) ahead of a long shared system
prompt defeats it: the shared blocks repeat *by content* across requests, yet their chained hashes
never match. The detector keeps two bounded sketches per route — chained hashes (what the cache
can reuse) and un-chained per-block content hashes (what repeats at all) — and flags a route when
a large share of blocks repeat by content *after* the chained prefix has already missed.
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from routing.contracts import TokenizedPrompt
from routing.types import BlockHash

log = logging.getLogger(__name__)


class BoundedSet:
    """A set that forgets its oldest members beyond ``capacity`` (a cheap recency sketch)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, item: int) -> bool:
        return item in self._items

    def add(self, item: int) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def block_content_hashes(prompt: TokenizedPrompt, block_size: int) -> list[int]:
    """Un-chained hash of each full block's content alone (no parent, no seed)."""
    if prompt.token_ids is not None:
        data = np.asarray(prompt.token_ids, dtype="<u4").tobytes()
    else:
        data = (prompt.text or "").encode("utf-32-le", "surrogatepass")
    step = block_size * 4
    view = memoryview(data)
    return [
        xxhash.xxh3_64_intdigest(view[i : i + step]) for i in range(0, len(data) - step + 1, step)
    ]


@dataclass
class _Observation:
    blocks: int
    prefix_repeat_blocks: int
    #: Blocks after the first chained miss whose content was seen before.
    content_repeat_after_miss: int
    first_miss: int


@dataclass
class RouteLayout:
    """Sketches and recent observations of one route."""

    chained: BoundedSet
    content: BoundedSet
    recent: deque[_Observation]
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
        sketch_capacity: int = 65_536,
        recent_requests: int = 500,
        min_requests: int = 20,
        busting_threshold: float = 0.3,
    ) -> None:
        self.sketch_capacity = sketch_capacity
        self.recent_requests = recent_requests
        self.min_requests = min_requests
        self.busting_threshold = busting_threshold
        self._routes: dict[str, RouteLayout] = {}

    def observe(
        self, route: str, prompt: TokenizedPrompt, chain: Sequence[BlockHash], block_size: int
    ) -> None:
        """Account one request's prompt blocks, then remember them."""
        state = self._routes.get(route)
        if state is None:
            state = RouteLayout(
                BoundedSet(self.sketch_capacity),
                BoundedSet(self.sketch_capacity),
                deque(maxlen=self.recent_requests),
            )
            self._routes[route] = state
        contents = block_content_hashes(prompt, block_size)
        prefix = 0
        while prefix < len(chain) and chain[prefix] in state.chained:
            prefix += 1
        after_miss = sum(1 for h in contents[prefix:] if h in state.content)
        state.recent.append(_Observation(len(chain), prefix, after_miss, prefix))
        for h in chain:
            state.chained.add(h)
        for h in contents:
            state.content.add(h)
        report = self._report(route, state)
        state.detected = report.cache_busting_layout
        if state.detected and not state.warned:
            state.warned = True
            log.warning(
                "route %s: cache-busting prompt layout: %.0f%% of prompt blocks repeat by content "
                "after the shared prefix already diverged (median divergence at block %s). %s",
                route,
                report.content_repeat_after_miss_fraction * 100,
                report.median_first_miss_block,
                report.advice,
            )

    def _report(self, route: str, state: RouteLayout) -> LayoutReport:
        blocks = sum(o.blocks for o in state.recent)
        repeat = sum(o.prefix_repeat_blocks for o in state.recent) / blocks if blocks else 0.0
        after = sum(o.content_repeat_after_miss for o in state.recent) / blocks if blocks else 0.0
        busting = (
            len(state.recent) >= self.min_requests
            and after >= self.busting_threshold
            and after > repeat
        )
        misses = [o.first_miss for o in state.recent if o.content_repeat_after_miss]
        median = float(statistics.median(misses)) if misses else None
        advice = (
            "Move per-request content (timestamps, ids, user data) after the shared part of the "
            "prompt so the shared blocks form a common prefix."
            if busting
            else None
        )
        return LayoutReport(route, len(state.recent), repeat, after, busting, median, advice)

    def reports(self) -> list[LayoutReport]:
        """One report per route seen."""
        return [self._report(route, state) for route, state in self._routes.items()]
