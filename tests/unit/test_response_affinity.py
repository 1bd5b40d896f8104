"""The in-memory response-affinity map: expiry on an injected clock, bounded size."""

from __future__ import annotations

from gateway.response_affinity import MemoryResponseAffinity, ResponseHome
from routing.types import ReplicaId

HOME = ResponseHome(ReplicaId("sim/0"), "acme")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_remembered_until_the_ttl_passes() -> None:
    clock = Clock()
    affinity = MemoryResponseAffinity(ttl_s=60, clock=clock)
    await affinity.remember("resp_a", HOME)
    clock.now += 59.9
    assert await affinity.home_of("resp_a") == HOME
    clock.now += 0.1
    assert await affinity.home_of("resp_a") is None
    assert await affinity.home_of("resp_never") is None


async def test_oldest_dropped_past_capacity() -> None:
    affinity = MemoryResponseAffinity(capacity=2)
    for name in ("a", "b", "c"):
        await affinity.remember(name, HOME)
    assert await affinity.home_of("a") is None
    assert await affinity.home_of("b") == HOME
    assert await affinity.home_of("c") == HOME
