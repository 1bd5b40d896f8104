"""Two gateways (two registries) sharing real Redis and one simulated vLLM replica."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from adapters_registry.placement_redis import RedisPlacementStore
from adapters_registry.registry import AdapterRegistry
from gateway.engine_api import EngineLoraClient
from replica.sim.fleet import SimFleet, start_sim_fleet
from routing.state import ReplicaState
from routing.types import ReplicaId
from tests.integration.test_adapters_fixtures import (
    count_engine_loads,
    eventually,
    load_call_counter,
    served_adapters,
)
from tests.support.redis_server import RedisServer
from tests.unit.test_adapters_fixtures import FakeEngine, adapter, make_policy, replica

pytestmark = pytest.mark.redis

ADAPTERS = [adapter(n) for n in ("a", "b", "c")]


@dataclass
class Gateways:
    """Two registries sharing one Redis prefix, and the load-API calls their sessions made."""

    g1: AdapterRegistry
    g2: AdapterRegistry
    redis: Redis
    load_calls: list[str]


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with start_sim_fleet(
        1, kv_events=None, kv_replay=None, speed=1000.0, max_loras=1,
        engine_overrides={"max_cpu_loras": 2},
    ) as running:
        yield running


@pytest.fixture
async def gateways(fleet: SimFleet, redis_url: str) -> AsyncIterator[Gateways]:
    prefix = f"fg-test-{uuid.uuid4().hex[:8]}:"
    policy = make_policy(ADAPTERS, urls=fleet.urls, max_loras=1, max_cpu_loras=2)
    client = Redis.from_url(redis_url, decode_responses=True)
    trace, calls = load_call_counter()
    async with aiohttp.ClientSession(trace_configs=[trace]) as s1, \
            aiohttp.ClientSession(trace_configs=[trace]) as s2:
        g1 = AdapterRegistry(policy, RedisPlacementStore(client, prefix), EngineLoraClient(s1),
                             metrics_registry=CollectorRegistry(), gateway_id="g1")
        g2 = AdapterRegistry(policy, RedisPlacementStore(client, prefix), EngineLoraClient(s2),
                             metrics_registry=CollectorRegistry(), gateway_id="g2")
        yield Gateways(g1, g2, client, calls)
        await g1.close()
        await g2.close()
    await client.delete(*[k async for k in client.scan_iter(match=f"{prefix}*")] or ["none"])
    await client.aclose()


def state(fleet: SimFleet) -> ReplicaState:
    return replica("sim-0", url=fleet.urls[0])


def lock_key(reg: AdapterRegistry, adapter_name: str) -> str:
    store = reg.store
    assert isinstance(store, RedisPlacementStore)
    return store.lock_key(ReplicaId("sim-0"), adapter_name)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_two_gateways_cold_adapter_one_load(
    fleet: SimFleet,
    gateways: Gateways,
    session: aiohttp.ClientSession,
) -> None:
    g1, g2, client = gateways.g1, gateways.g2, gateways.redis
    handle = fleet.replicas[0]
    loads = count_engine_loads(handle)
    r0 = state(fleet)
    async with handle.replica.lora_lock:  # the load cannot finish while we hold this
        first = asyncio.create_task(g1.ensure_loaded(r0, "a"))
        await eventually(lambda: client.exists(lock_key(g1, "a")))
        second = asyncio.create_task(g2.ensure_loaded(r0, "a"))
        await eventually(lambda: g2.loader.lock_contentions >= 1)
    results = await asyncio.gather(first, second)
    assert len(gateways.load_calls) == 1  # one HTTP load from both gateways together
    assert loads == ["a"]
    assert [r.loaded_now for r in results] == [True, False]
    assert await served_adapters(session, r0.url) == ["a"]
    assert not await client.exists(lock_key(g1, "a"))


async def test_lock_of_a_dead_gateway_expires(
    fleet: SimFleet, gateways: Gateways
) -> None:
    g1, client = gateways.g1, gateways.redis
    loads = count_engine_loads(fleet.replicas[0])
    # A gateway took the lock and died: nobody will release it, its expiry must.
    await client.set(lock_key(g1, "a"), "dead-gateway", px=200)
    result = await g1.ensure_loaded(state(fleet), "a")
    assert result.loaded_now
    assert g1.loader.lock_contentions >= 1
    assert loads == ["a"]


async def test_gateways_share_slots_and_in_flight_requests(
    fleet: SimFleet,
    gateways: Gateways,
    session: aiohttp.ClientSession,
) -> None:
    g1, g2 = gateways.g1, gateways.g2
    r0 = state(fleet)
    await g1.ensure_loaded(r0, "a")
    await g1.ensure_loaded(r0, "b")  # a is now the least recently used
    async with g1.serving(r0, "a"):  # ...but g1 has a request in flight on it
        await g2.ensure_loaded(r0, "c")
        assert sorted(await served_adapters(session, r0.url)) == ["a", "c"]
    b = g2.catalog.metrics_label("b")  # private adapters are labelled opaquely
    assert g2.metrics.unloads.labels(adapter=b, replica="sim-0", reason="lru")._value.get() == 1


async def test_redis_outage_degrades_to_unlocked_loads(
    fleet: SimFleet, redis_server: RedisServer
) -> None:
    policy = make_policy(ADAPTERS, urls=fleet.urls)
    store = RedisPlacementStore.from_url(redis_server.url)
    loads = count_engine_loads(fleet.replicas[0])
    async with aiohttp.ClientSession() as session:
        reg = AdapterRegistry(
            policy, store, EngineLoraClient(session), metrics_registry=CollectorRegistry()
        )
        redis_server.stop()
        assert (await reg.ensure_loaded(state(fleet), "a")).loaded_now
        # Without the store the registry cannot know it is resident; the engine's own
        # "already loaded" answer keeps the second call from loading twice.
        assert not (await reg.ensure_loaded(state(fleet), "a")).loaded_now
        await reg.close()
    assert loads == ["a"]


async def test_gateways_plan_pre_warming_from_the_fleets_traffic(redis_server: RedisServer) -> None:
    """The live adapter review: two gateways planned from their own traffic alone, so each saw
    the other's hot adapter as idle and evicted it to replicate its own (39 loads, 31 unloads in
    100 s with room for all). Each now adds its counts to the shared window and plans from the
    fleet's; with Redis gone it plans from its own again."""
    policy = make_policy([adapter(n) for n in "abcd"], max_loras=1, max_cpu_loras=2)
    stores = [RedisPlacementStore.from_url(redis_server.url) for _ in range(2)]
    regs = [
        AdapterRegistry(policy, store, FakeEngine(), metrics_registry=CollectorRegistry())
        for store in stores
    ]
    states = [
        replica("r0", loaded=("a", "b"), max_loras=1, max_cpu_loras=2),
        replica("r1", loaded=("b", "c"), max_loras=1, max_cpu_loras=2),
    ]
    try:
        hot = {0: "a", 1: "b"}  # each gateway sees one tenant's traffic
        for i, name in hot.items():
            for _ in range(60):
                regs[i].record_request(name)
        # Alone, the first gateway replicates "a" onto r1 by evicting "b" (idle, as it sees it).
        steps = regs[0].plan(states).steps
        assert ("r1", "a", "b") in {(s.replica, s.adapter, s.evict) for s in steps}
        # The first reads again after the second wrote; writing its window twice (as a retry
        # after a timeout would) counts nothing twice.
        for reg in (*regs, regs[0]):
            await reg.traffic.sync(reg.store, time.time())
        for i, reg in enumerate(regs):
            assert reg.traffic.counts(time.time()) == {"a": 60, "b": 60}
            other = hot[1 - i]
            assert other not in {step.evict for step in reg.plan(states).steps}, i
        regs[0].record_request("a")  # not yet sent: counted from this gateway's own
        assert regs[0].traffic.counts(time.time()) == {"a": 61, "b": 60}
        redis_server.stop()
        await regs[0].traffic.sync(regs[0].store, time.time())
        assert regs[0].traffic.counts(time.time()) == {"a": 61}  # its own, as before
    finally:
        for reg in regs:
            await reg.close()


async def test_a_gateway_retracts_its_traffic_for_an_adapter_a_reload_removed(
    redis_server: RedisServer,
) -> None:
    """The LoRA-reload review: the gateway that had reloaded went on publishing its counts for
    a removed adapter, and a gateway still on the old policy pre-warmed it onto more replicas."""
    policy = make_policy([adapter(n) for n in "ab"], max_loras=1, max_cpu_loras=2)
    stores = [RedisPlacementStore.from_url(redis_server.url) for _ in range(2)]
    reloaded, lagging = (
        AdapterRegistry(policy, store, FakeEngine(), metrics_registry=CollectorRegistry())
        for store in stores
    )
    try:
        for _ in range(30):
            reloaded.record_request("a")
        reloaded.record_request("b")
        await reloaded.traffic.sync(reloaded.store, time.time())
        await lagging.traffic.sync(lagging.store, time.time())
        assert lagging.traffic.counts(time.time()) == {"a": 30, "b": 1}

        assert reloaded.update_policy(make_policy([adapter("b")])) == ["a"]
        assert reloaded.traffic.counts(time.time()) == {"b": 1}
        await reloaded.traffic.sync(reloaded.store, time.time())
        await lagging.traffic.sync(lagging.store, time.time())
        assert lagging.traffic.counts(time.time()).get("a", 0) == 0
        assert lagging.traffic.counts(time.time())["b"] == 1
    finally:
        await reloaded.close()
        await lagging.close()
