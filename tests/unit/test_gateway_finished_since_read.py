"""A replica's ``running`` gauge forgets the requests the gateway has seen end since it was read.

Engine figures reach the gateway up to a poll interval late (an agent's scrape, merged every
couple of seconds). Between a reading and the next, the gauge still counts requests that have
finished; the real-vLLM prefix test saw it: a replica that had answered one request kept a
decode-contention charge for the whole first round while the other replica's finished requests
had never been counted, and a burst of new prefixes went 6 to 2 and overflowed one engine's cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from gateway.inflight import ENDED_KEPT, MemoryInflight
from gateway.replicas import ReplicaRegistry
from routing.state import ReplicaState
from routing.types import ReplicaId

R = ReplicaId("pool/r0")

#: How ``view`` brings the tracker's counts in: every replica (``set_inflight``), or only those
#: where something changed (``refresh_inflight``, the request path). Both must agree.
_REFRESH = {"incremental": True}


@pytest.fixture(autouse=True, params=["every-replica", "incremental"])
def refresh_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    _REFRESH["incremental"] = request.param == "incremental"
    yield


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def registry_reading(running: int, read_at: float) -> ReplicaRegistry:
    registry = ReplicaRegistry()
    registry.upsert(ReplicaState(R, "http://r0", running=running, metrics_read_at=read_at))
    return registry


def reread(registry: ReplicaRegistry, running: int, read_at: float) -> None:
    """A new engine reading arrives (as an agent's scrape or a health poll brings it)."""
    state = registry.get(R)
    assert state is not None
    registry.sync_discovered([replace(state, running=running, metrics_read_at=read_at)])


def view(registry: ReplicaRegistry, inflight: MemoryInflight) -> ReplicaState:
    if _REFRESH["incremental"]:
        registry.refresh_inflight(inflight)
    else:
        registry.set_inflight(inflight.counts(), inflight.ended_since, inflight.awaiting_prefill)
    state = registry.get(R)
    assert state is not None
    return state


def test_a_request_that_ended_after_the_reading_comes_off_the_gauge() -> None:
    clock = Clock(100.0)
    inflight = MemoryInflight(clock)
    inflight.start(R, 100)  # sent at 100.0 ...
    registry = registry_reading(running=1, read_at=100.5)  # ... read running at 100.5 ...
    assert view(registry, inflight).running_now == 1
    clock.now = 101.0
    inflight.finish(R, 0, started_at=100.0)  # ... ended at 101.0
    state = view(registry, inflight)
    assert (state.finished_since_read, state.running_now) == (1, 0)


def test_kv_usage_loses_the_share_of_the_requests_that_ended() -> None:
    """vLLM frees a finished request's blocks at once: a KV gauge read during a burst must not
    keep a replica looking full after the burst ended (the real-vLLM prefix test's first round
    read one engine at 93% and sent every later request for its prefixes to the other)."""
    clock = Clock(100.0)
    inflight = MemoryInflight(clock)
    for _ in range(4):
        inflight.start(R, 100)
    registry = ReplicaRegistry()
    registry.upsert(ReplicaState(R, "http://r0", running=4, kv_usage=0.92, metrics_read_at=100.5))
    assert view(registry, inflight).kv_usage_now == pytest.approx(0.92)
    clock.now = 101.0
    inflight.finish(R, 0, started_at=100.0)
    inflight.finish(R, 0, started_at=100.0)
    state = view(registry, inflight)
    assert (state.kv_usage, state.kv_usage_now) == (0.92, pytest.approx(0.46))
    inflight.finish(R, 0, started_at=100.0)
    inflight.finish(R, 0, started_at=100.0)
    assert view(registry, inflight).kv_usage_now == 0.0


def test_requests_with_their_first_token_are_not_queued_behind_an_old_gauge() -> None:
    """Between polls, the gateway's in-flight requests beyond the ``running`` gauge counted as
    queued even once decoding: two decodes sent since a poll made an idle-queued engine look
    congested. Only those still waiting for their first token are queued."""
    clock = Clock(100.0)
    inflight = MemoryInflight(clock)
    registry = registry_reading(running=0, read_at=99.0)
    inflight.start(R, 800)
    inflight.start(R, 800)
    state = view(registry, inflight)
    assert (state.inflight_unprefilled, state.queued, state.running_now) == (2, 2, 2)
    inflight.prefilled(R, 800)
    state = view(registry, inflight)
    assert (state.inflight_unprefilled, state.queued, state.running_now) == (1, 1, 2)
    inflight.prefilled(R, 800)
    state = view(registry, inflight)
    assert (state.inflight_unprefilled, state.queued, state.load) == (0, 0, 2)
    # A request that ends without a first token (an error, a disconnect) leaves the count too.
    inflight.start(R, 50)
    inflight.finish(R, 50, started_at=100.0, awaiting_prefill=True)
    inflight.finish(R, 0, started_at=100.0)
    state = view(registry, inflight)
    assert (state.inflight_requests, state.inflight_unprefilled, state.queued) == (1, 0, 0)
    # The engine's own waiting queue (other clients') still counts.
    reread(registry, running=1, read_at=100.0)
    registry.sync_discovered([replace(view(registry, inflight), waiting=3)])
    assert view(registry, inflight).queued == 3


def test_a_reading_that_arrives_after_the_end_is_still_corrected() -> None:
    """The agent read the engine while the request ran; the gateway merged it after the end."""
    clock = Clock(101.0)
    inflight = MemoryInflight(clock)
    inflight.start(R, 0)
    inflight.finish(R, 0, started_at=100.0)
    registry = registry_reading(running=1, read_at=100.5)
    state = view(registry, inflight)
    assert (state.finished_since_read, state.running_now) == (1, 0)


def test_requests_sent_after_the_reading_or_ended_before_it_are_not_subtracted() -> None:
    clock = Clock(102.0)
    inflight = MemoryInflight(clock)
    for sent in (99.0, 101.0):  # one sent before the reading, one after; both ended at 102
        inflight.start(R, 0)
        inflight.finish(R, 0, started_at=sent)
    registry = registry_reading(running=3, read_at=100.0)
    assert view(registry, inflight).finished_since_read == 1
    assert view(registry, inflight).running_now == 2  # other clients' requests stay counted
    reread(registry, running=3, read_at=102.5)  # a reading after both ended: nothing to take
    assert view(registry, inflight).running_now == 3


def test_the_gateways_own_count_is_a_floor() -> None:
    clock = Clock(102.0)
    inflight = MemoryInflight(clock)
    for _ in range(3):
        inflight.start(R, 0)
        inflight.finish(R, 0, started_at=99.0)
    inflight.start(R, 0)
    inflight.start(R, 0)
    state = view(registry_reading(running=1, read_at=100.0), inflight)
    assert state.running - state.finished_since_read == -2
    assert state.running_now == 2


def test_memory_is_bounded_and_an_attempt_without_a_send_time_counts_nothing() -> None:
    clock = Clock(10.0)
    inflight = MemoryInflight(clock)
    for _ in range(ENDED_KEPT + 50):
        inflight.start(R, 0)
        inflight.finish(R, 0, started_at=1.0)
    inflight.start(R, 0)
    inflight.finish(R, 0)
    assert inflight.ended_since(R, 5.0) == ENDED_KEPT
    assert inflight.ended_since(ReplicaId("other"), 5.0) == 0


def test_without_the_tracker_nothing_is_subtracted() -> None:
    registry = registry_reading(running=4, read_at=10.0)
    registry.set_inflight({R: (1, 0)})
    state = registry.get(R)
    assert state is not None and state.running_now == 4
