"""A replica its agent is stopping on purpose (``fleetgate replica run`` got SIGTERM).

While it drains, the gateway sends it nothing new and lets the requests it holds finish there:
moving them, as for a replica reported down, reran every unanswered request from its first
token on another replica (live review, a rolling restart of two real vLLM replicas behind one
gateway: two 1.8 s requests took 8.3 and 6.9 s). Once its agent has removed it from the fleet
it stays out, whatever its health polls say: they still passed for a second or two after an
engine stopped, and the gateway routed to it again until two of them had missed.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from dataclasses import replace

import aiohttp
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy
from replica.fleet_store import MemoryFleetStore
from routing.state import ReplicaState
from routing.types import ReplicaId
from tests.integration.test_gateway_replica_down import ADMIN, CHAT, _metric, _one_held_by
from tests.integration.test_gateway_support import FakeUpstream, serve
from tests.support.polling import wait_until

TTL_S = 60.0


async def _health(http: aiohttp.ClientSession, url: str) -> dict[str, bool]:
    async with http.get(f"{url}/admin/replicas", headers=ADMIN) as resp:
        return {r["replica_id"]: r["healthy"] for r in (await resp.json())["replicas"]}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_draining_replica_finishes_what_it_holds_takes_nothing_new_and_stays_out(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.replicas")
    draining = FakeUpstream(header_gate=asyncio.Event())  # holds requests until the gate opens
    well = FakeUpstream()
    store = MemoryFleetStore()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        states = {}
        for name, upstream in (("draining", draining), ("well", well)):
            replica_url = await stack.enter_async_context(serve(upstream.app()))
            states[name] = ReplicaState(
                replica_id=ReplicaId(name), url=replica_url, models=frozenset(upstream.models)
            )
            await store.register(states[name], TTL_S)
        cfg = GatewayConfig(health_interval_s=0.05, admin_key="adm")
        url = await stack.enter_async_context(
            serve(create_app(cfg, GatewayPolicy.default([]), fleet_store=store),
                  handler_cancellation=True)
        )
        await wait_until(
            lambda: _health(http, url), "both replicas discovered", timeout_s=10
        )
        held = await _one_held_by(http, url, stream, draining)

        # Its agent reports the drain (``ReplicaAgent.leave``): down for new requests.
        await store.publish(replace(states["draining"], healthy=False, draining=True), TTL_S)

        async def out_of_routing() -> bool:
            return (await _health(http, url)).get("draining") is False

        await wait_until(out_of_routing, "the gateway hears of the drain", timeout_s=10)
        for _ in range(5):
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
        assert draining.attempts == 1  # nothing new went there
        assert not held.done()  # ... and what it held was left to it

        draining.header_gate.set()  # type: ignore[union-attr]  # the engine answers
        status, body = await asyncio.wait_for(held, timeout=30)
        assert status == 200, body
        if stream:
            assert body.endswith(b"data: [DONE]\n\n")
        assert draining.attempts == 1  # answered where it ran, never rerun elsewhere
        retries = await _metric(http, url, "fleetgate_upstream_retries_total")
        assert retries == 0

        # The drain is over and the engine stops (``replica run``'s next step): with nothing
        # held, that is no outage to warn about (diff review: every rolling restart did).
        await store.publish(replace(states["draining"], healthy=False, draining=False), TTL_S)
        await wait_until(
            lambda: any("stopped after its drain" in r.getMessage() for r in caplog.records),
            "the gateway hears the engine stopped",
        )
        assert not [r for r in caplog.records if "marked unhealthy" in r.getMessage()]

        # The agent removes it from the fleet; its engine (here) still answers health polls.
        await store.remove(ReplicaId("draining"))
        polls = draining.health_polls
        await wait_until(lambda: draining.health_polls >= polls + 5, "five more health polls")
        assert (await _health(http, url))["draining"] is False
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        assert draining.attempts == 1


async def test_a_replica_whose_agent_leaves_alone_keeps_what_it_holds() -> None:
    """``fleetgate agent`` stopped beside an engine that keeps running (a sidecar restart):
    the replica takes nothing new, and the request it holds finishes there rather than being
    rerun elsewhere (diff review)."""
    holder = FakeUpstream(header_gate=asyncio.Event())
    well = FakeUpstream()
    store = MemoryFleetStore()
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        for name, upstream in (("holder", holder), ("well", well)):
            replica_url = await stack.enter_async_context(serve(upstream.app()))
            await store.register(
                ReplicaState(replica_id=ReplicaId(name), url=replica_url,
                             models=frozenset(upstream.models)),
                TTL_S,
            )
        cfg = GatewayConfig(health_interval_s=0.05, admin_key="adm")
        url = await stack.enter_async_context(
            serve(create_app(cfg, GatewayPolicy.default([]), fleet_store=store),
                  handler_cancellation=True)
        )
        await wait_until(lambda: _health(http, url), "both replicas discovered", timeout_s=10)
        held = await _one_held_by(http, url, False, holder)
        await store.remove(ReplicaId("holder"))

        async def out_of_routing() -> bool:
            return (await _health(http, url)).get("holder") is False

        await wait_until(out_of_routing, "the gateway hears it left", timeout_s=10)
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
        holder.header_gate.set()  # type: ignore[union-attr]
        status, body = await asyncio.wait_for(held, timeout=30)
        assert status == 200, body
        assert holder.attempts == 1
        assert await _metric(http, url, "fleetgate_upstream_retries_total") == 0


async def test_a_replica_registered_before_its_engine_answered_shows_no_staleness() -> None:
    """An agent registers its replica before its engine's figures are read (a restart): the
    admin API said ``staleness_s: 1796603438`` (seconds since 1970) for it (live review)."""
    store = MemoryFleetStore()
    await store.register(
        ReplicaState(replica_id=ReplicaId("starting"), url="http://127.0.0.1:9", healthy=False,
                     models=frozenset({"base-model"}), metrics_read_at=0.0),
        TTL_S,
    )
    cfg = GatewayConfig(health_interval_s=0.05, admin_key="adm")
    async with serve(create_app(cfg, GatewayPolicy.default([]), fleet_store=store)) as url, \
            aiohttp.ClientSession() as http:

        async def listed() -> list[dict]:
            async with http.get(f"{url}/admin/replicas", headers=ADMIN) as resp:
                return (await resp.json())["replicas"]

        await wait_until(listed, "the replica discovered", timeout_s=10)
        (replica,) = await listed()
        assert replica["staleness_s"] is None
        async with http.get(f"{url}/dashboard/data", headers=ADMIN) as resp:
            assert resp.status == 200
            page = await resp.json()
    assert [r["staleness_s"] for r in page["replicas"]] == [None]
