"""The adapter registry against simulated vLLM replicas (real HTTP, vLLM's runtime LoRA API)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from adapters_registry.errors import AdapterLoadFailed, NoAdapterSlot
from adapters_registry.registry import AdapterRegistry
from gateway.engine_api import EngineLoraClient
from replica.sim.fleet import SimFleet, start_sim_fleet
from routing.state import ReplicaState
from tests.integration.test_adapters_fixtures import (
    count_engine_loads,
    eventually,
    load_call_counter,
    served_adapters,
)
from tests.unit.test_adapters_fixtures import adapter, make_policy, replica

ADAPTERS = [adapter(n) for n in ("a", "b", "c", "d")] + [adapter("pin", pinned=True)]


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    # One GPU slot and a host cache of two: the registry keeps at most two resident.
    async with start_sim_fleet(
        2, kv_events=None, kv_replay=None, speed=1000.0, max_loras=1,
        engine_overrides={"max_cpu_loras": 2},
    ) as running:
        yield running


@pytest.fixture
def load_calls() -> tuple[aiohttp.TraceConfig, list[str]]:
    return load_call_counter()


@pytest.fixture
async def session(
    load_calls: tuple[aiohttp.TraceConfig, list[str]],
) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(trace_configs=[load_calls[0]]) as s:
        yield s


@pytest.fixture
async def registry(
    fleet: SimFleet, session: aiohttp.ClientSession
) -> AsyncIterator[AdapterRegistry]:
    policy = make_policy(ADAPTERS, urls=fleet.urls, max_loras=1, max_cpu_loras=2)
    reg = AdapterRegistry.in_memory(
        policy, EngineLoraClient(session), metrics_registry=CollectorRegistry()
    )
    yield reg
    await reg.close()


def states(fleet: SimFleet) -> list[ReplicaState]:
    return [replica(f"sim-{i}", url=url) for i, url in enumerate(fleet.urls)]


async def test_loads_then_evicts_least_recently_used(
    fleet: SimFleet, registry: AdapterRegistry, session: aiohttp.ClientSession
) -> None:
    r0 = states(fleet)[0]
    assert (await registry.ensure_loaded(r0, "a")).loaded_now
    assert (await registry.ensure_loaded(r0, "b")).loaded_now
    async with registry.serving(r0, "a") as result:  # a used again: b becomes the oldest
        assert not result.loaded_now and result.cold_ms == 0.0
    await registry.ensure_loaded(r0, "c")
    assert sorted(await served_adapters(session, r0.url)) == ["a", "c"]
    assert await served_adapters(session, fleet.urls[1]) == []  # other replica untouched
    m, label = registry.metrics, registry.catalog.metrics_label  # private: opaque labels
    assert m.unloads.labels(adapter=label("b"), replica="sim-0", reason="lru")._value.get() == 1
    assert m.loads.labels(adapter=label("c"), replica="sim-0", outcome="ok")._value.get() == 1
    assert m.cold_start.labels(adapter=label("c"))._sum.get() > 0


async def test_pinned_adapter_survives_and_busy_replica_refuses(
    fleet: SimFleet, registry: AdapterRegistry, session: aiohttp.ClientSession
) -> None:
    r0 = states(fleet)[0]
    await registry.ensure_loaded(r0, "pin")
    await registry.ensure_loaded(r0, "a")
    await registry.ensure_loaded(r0, "b")  # evicts a, never pin
    assert sorted(await served_adapters(session, r0.url)) == ["b", "pin"]
    async with registry.serving(r0, "b"):
        with pytest.raises(NoAdapterSlot, match="sim-0"):
            await registry.ensure_loaded(r0, "c")
    assert sorted(await served_adapters(session, r0.url)) == ["b", "pin"]


async def test_concurrent_requests_for_a_cold_adapter_trigger_one_load(
    fleet: SimFleet,
    registry: AdapterRegistry,
    session: aiohttp.ClientSession,
    load_calls: tuple[aiohttp.TraceConfig, list[str]],
) -> None:
    handle = fleet.replicas[0]
    r0 = states(fleet)[0]
    loads = count_engine_loads(handle)
    # Hold the engine's LoRA lock so the load cannot finish before every caller has arrived.
    async with handle.replica.lora_lock:
        tasks = [asyncio.create_task(registry.ensure_loaded(r0, "a")) for _ in range(8)]
        await eventually(lambda: registry.loader.waiting(r0.replica_id, "a") == 8)
    results = await asyncio.gather(*tasks)
    assert load_calls[1] == [f"{r0.url}/v1/load_lora_adapter"]
    assert loads == ["a"]
    assert sum(r.loaded_now for r in results) == 1
    assert await served_adapters(session, r0.url) == ["a"]


async def test_adapter_serves_completions_once_loaded(
    fleet: SimFleet, registry: AdapterRegistry, session: aiohttp.ClientSession
) -> None:
    r1 = states(fleet)[1]
    body = {"model": "d", "prompt": "hello", "max_tokens": 2}
    async with session.post(f"{r1.url}/v1/completions", json=body) as resp:
        assert resp.status == 404  # not loaded: the engine does not know the name
    async with registry.serving(r1, "d") as result:
        assert result.loaded_now
        async with session.post(f"{r1.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["model"] == "d"


async def test_already_loaded_by_someone_else_is_success(
    fleet: SimFleet, registry: AdapterRegistry, session: aiohttp.ClientSession
) -> None:
    r0 = states(fleet)[0]
    load = {"lora_name": "a", "lora_path": "/adapters/acme/a"}
    async with session.post(f"{r0.url}/v1/load_lora_adapter", json=load) as resp:
        assert resp.status == 200
    result = await registry.ensure_loaded(r0, "a")
    assert result.loaded_now is False
    assert await served_adapters(session, r0.url) == ["a"]


async def test_refresh_adopts_the_engines_view(
    fleet: SimFleet, registry: AdapterRegistry, session: aiohttp.ClientSession
) -> None:
    r0 = states(fleet)[0]
    await registry.ensure_loaded(r0, "a")
    # Someone unloads "a" behind the registry's back and loads "b".
    async with session.post(f"{r0.url}/v1/unload_lora_adapter", json={"lora_name": "a"}):
        pass
    async with session.post(
        f"{r0.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/adapters/acme/b"}
    ):
        pass
    polled = replica("sim-0", url=r0.url, loaded=await served_adapters(session, r0.url),
                     read_at=registry._clock() + 60)  # read after the grace period
    await registry.refresh([polled])
    assert registry.view.get(r0.replica_id).resident == {"b"}
    assert registry.cold_load_ms(polled, "b") == 0.0
    assert registry.cold_load_ms(polled, "a") > 0.0
    assert (await registry.ensure_loaded(polled, "a")).loaded_now


async def test_engine_refusal_carries_its_message(session: aiohttp.ClientSession) -> None:
    async with start_sim_fleet(1, kv_events=None, kv_replay=None, max_loras=0) as no_lora:
        policy = make_policy(ADAPTERS, urls=no_lora.urls)
        reg = AdapterRegistry.in_memory(
            policy, EngineLoraClient(session), metrics_registry=CollectorRegistry()
        )
        with pytest.raises(AdapterLoadFailed) as err:
            await reg.ensure_loaded(replica("solo", url=no_lora.urls[0]), "a")
        assert err.value.status == 500
        assert "LoRA is disabled" in err.value.engine_message
        await reg.close()


async def test_unreachable_replica_is_a_load_failure(
    registry: AdapterRegistry,
) -> None:
    dead = replica("dead", url="http://127.0.0.1:9")
    with pytest.raises(AdapterLoadFailed, match="request failed"):
        await registry.ensure_loaded(dead, "a")



async def test_prewarm_places_pinned_and_hot_adapters(
    fleet: SimFleet, session: aiohttp.ClientSession
) -> None:
    catalog = [
        adapter("pin", pinned=True, prewarm_replicas=2),
        adapter("hot"),
        adapter("cold"),
        adapter("idle"),
    ]
    policy = make_policy(catalog, urls=fleet.urls, max_loras=1, max_cpu_loras=2)
    reg = AdapterRegistry.in_memory(
        policy, EngineLoraClient(session), metrics_registry=CollectorRegistry()
    )
    for _ in range(9):
        reg.record_request("hot")
    reg.record_request("cold")
    replicas = states(fleet)
    report = await reg.prewarm(replicas)
    assert report.failed == []
    # 4 slots x 0.75 = 3 for the plan: pin's floor takes 2; hot gets 1 and cold 1 (budget
    # trimmed from hot's share), placed where the slots are free.
    assert reg.plan(replicas).desired == {"pin": 2, "hot": 1, "cold": 1, "idle": 0}
    served = [set(await served_adapters(session, url)) for url in fleet.urls]
    assert all("pin" in s for s in served)
    assert sum("hot" in s for s in served) == 1 and sum("cold" in s for s in served) == 1
    assert "idle" not in set.union(*served)
    # A second round finds nothing to do.
    again = await reg.prewarm(replicas)
    assert again.loaded == [] and again.failed == []
    await reg.close()


async def test_admin_add_then_remove_unloads_everywhere(
    fleet: SimFleet, registry: AdapterRegistry, session: aiohttp.ClientSession
) -> None:
    registry.add(adapter("acme-runtime", source="/adapters/acme/runtime"))
    replicas = states(fleet)
    for r in replicas:
        await registry.ensure_loaded(r, "acme-runtime")
    assert [await served_adapters(session, url) for url in fleet.urls] == [["acme-runtime"]] * 2
    assert await registry.remove("acme-runtime", replicas) == []
    assert [await served_adapters(session, url) for url in fleet.urls] == [[], []]
    unloads, runtime = registry.metrics.unloads, registry.catalog.metrics_label("acme-runtime")
    assert unloads.labels(adapter=runtime, replica="sim-1", reason="admin")._value.get() == 1
