"""B2B SaaS fleet: one base model, 40 customer fine-tunes, Zipf traffic across customers.

Each record carries ``adapter`` (a fleetgate extension of the trace format). Each customer has
its own system prompt; prefixes are never shared across adapters, as in vLLM, where the LoRA
adapter is part of the block hash.
"""

from __future__ import annotations

import random

from bench.workloads.blocks import Segment
from bench.workloads.shapes.base import Shape, ShapedRequest, Zipf

ADAPTERS = 40
#: s ≈ 1.1: the top customer gets ~20% of traffic, the tail of 30 shares roughly a third.
ZIPF_EXPONENT = 1.1


def adapter_name(rank: int) -> str:
    """Adapter name of the customer at popularity ``rank`` (0 = busiest)."""
    return f"ft-{rank:02d}"


class B2BLora(Shape):
    """Per-customer system prompt + a unique request, routed to the customer's fine-tune."""

    name = "b2b-lora"
    summary = f"B2B SaaS: {ADAPTERS} LoRA fine-tunes with Zipf(s={ZIPF_EXPONENT}) traffic"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.adapters = Zipf([adapter_name(rank) for rank in range(ADAPTERS)], ZIPF_EXPONENT)
        self.system_tokens = {
            adapter_name(rank): self.tokens(1000, 0.5, 200, 4000) for rank in range(ADAPTERS)
        }

    def next_request(self) -> ShapedRequest:
        adapter = str(self.adapters.pick(self.rng))
        segments = (
            Segment(("b2b-system-prompt", adapter), self.system_tokens[adapter]),
            self.unique("request", self.tokens(300, 0.8, 10, 4000)),
        )
        return ShapedRequest(segments, self.tokens(150, 0.7, 5, 1500), adapter=adapter)
