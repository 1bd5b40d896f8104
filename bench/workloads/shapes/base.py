"""What every workload shape shares: the request it emits and a few seeded samplers."""

from __future__ import annotations

import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from bench.workloads.blocks import Segment


@dataclass(frozen=True, slots=True)
class ShapedRequest:
    """One request before it gets a timestamp and hash ids: its prompt as content segments."""

    segments: tuple[Segment, ...]
    output_length: int
    adapter: str | None = None


class Shape(ABC):
    """A workload shape: a stateful source of requests in arrival order.

    Shapes with sessions (multi-turn chat, agents) keep several sessions open and interleave
    their turns, so consecutive records belong to different sessions as in real traffic.
    """

    #: CLI name, e.g. ``rag``.
    name: str = ""
    #: One line for ``--help``.
    summary: str = ""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._ids = itertools.count()

    @abstractmethod
    def next_request(self) -> ShapedRequest:
        """The next request to arrive."""

    def unique(self, kind: str, length: int) -> Segment:
        """A segment of content that no other request shares (a user question, a tool output)."""
        return Segment((kind, next(self._ids)), length)

    def tokens(self, median: float, sigma: float, low: int, high: int) -> int:
        """A token count from a log-normal around ``median``, clipped to [low, high].

        Log-normal because prompt and output lengths in production traces are right-skewed.
        """
        value = self.rng.lognormvariate(math.log(median), sigma)
        return int(min(high, max(low, round(value))))


class Zipf:
    """Pick from ``items`` with probability proportional to 1 / rank**exponent (rank 1 = first)."""

    def __init__(self, items: Sequence[Hashable], exponent: float) -> None:
        if not items:
            raise ValueError("Zipf needs at least one item")
        self.items = list(items)
        weights = [1 / rank**exponent for rank in range(1, len(self.items) + 1)]
        self.cumulative = list(itertools.accumulate(weights))

    def pick(self, rng: random.Random) -> Hashable:
        """One item, drawn with ``rng``."""
        return rng.choices(self.items, cum_weights=self.cumulative, k=1)[0]
