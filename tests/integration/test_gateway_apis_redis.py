"""Two gateways sharing Redis share the Responses affinity: a follow-up sent to either gateway
lands on the replica that stored the previous response (two simulated replicas, real Redis)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import redis.asyncio
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.response_affinity import RedisResponseAffinity, ResponseHome
from gateway.state import GATEWAY
from replica.sim.fleet import SimFleet, start_sim_fleet
from routing.types import ReplicaId
from tests.integration.test_gateway_support import serve
from tests.support.polling import wait_until
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis

ADMIN_KEY = "apis-redis-admin"


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with start_sim_fleet(2, profile="tiny", speed=500, kv_events=None) as running:
        yield running


async def test_redis_affinity_round_trip_and_expiry(redis_url: str) -> None:
    prefix = f"test-{uuid.uuid4().hex}:"
    writer = RedisResponseAffinity(redis_url, key_prefix=prefix, ttl_s=60)
    reader = RedisResponseAffinity(redis_url, key_prefix=prefix, ttl_s=60)
    home = ResponseHome(ReplicaId("pool/1"), "acme")
    try:
        await writer.remember("resp_x", home)
        assert await reader.home_of("resp_x") == home
        assert await reader.home_of("resp_y") is None
        ttl_ms = await reader._redis.pttl(f"{prefix}response:resp_x")
        assert 0 < ttl_ms <= 60_000
    finally:
        await writer.close()
        await reader.close()


async def test_follow_up_through_the_other_gateway_lands_on_the_same_replica(
    redis_url: str, fleet: SimFleet
) -> None:
    specs = [
        ReplicaSpec(f"sim/{i}", url, models=frozenset({"sim-model"}))
        for i, url in enumerate(fleet.urls)
    ]

    def gateway() -> web.Application:
        config = GatewayConfig(redis_url=redis_url, admin_key=ADMIN_KEY, health_interval_s=3600)
        return create_app(config, GatewayPolicy.default(specs))

    async with serve(gateway()) as url_a, serve(gateway()) as url_b:
        clients = [
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            for url in (url_a, url_b)
        ]
        try:
            for c in range(4):
                first = await clients[0].responses.create(
                    model="sim-model", input=f"conversation {c} starts here", max_output_tokens=2,
                    extra_headers={"X-Request-Id": f"a-{c}"},
                )
                # Through the other gateway, with a prompt that shares nothing: only the
                # affinity in Redis can send it to the replica that holds the conversation.
                follow = await clients[1].responses.create(
                    model="sim-model", input="go on", previous_response_id=first.id,
                    max_output_tokens=2, extra_headers={"X-Request-Id": f"b-{c}"},
                )
                assert follow.previous_response_id == first.id
                # ... and the stored response is readable through either gateway.
                assert (await clients[1].responses.retrieve(first.id)).id == first.id
        finally:
            for client in clients:
                await client.close()
        async with aiohttp.ClientSession() as http:
            logs = []
            for url in (url_a, url_b):
                async with http.get(
                    f"{url}/admin/decisions?n=50", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
                ) as resp:
                    logs.append({d["request_id"]: d for d in (await resp.json())["decisions"]})
    for c in range(4):
        assert logs[1][f"b-{c}"]["served_by"] == logs[0][f"a-{c}"]["served_by"]
        assert logs[1][f"b-{c}"]["profile"] == "pinned"


async def test_responses_survive_a_redis_outage(redis_server: RedisServer, fleet: SimFleet) -> None:
    # With Redis down, a follow-up of a response this gateway served still finds its replica
    # (the gateway keeps its own entries); one it cannot know is a retryable 503, not a 404
    # saying the response does not exist; and what it recorded during the outage reaches the
    # other gateway once Redis answers again.
    specs = [
        ReplicaSpec(f"sim/{i}", url, models=frozenset({"sim-model"}))
        for i, url in enumerate(fleet.urls)
    ]

    def gateway() -> web.Application:
        config = GatewayConfig(
            redis_url=redis_server.url, admin_key=ADMIN_KEY, health_interval_s=3600
        )
        app = create_app(config, GatewayPolicy.default(specs))
        # Redis is left alone for a while after a failure; short here, so that the test
        # need not wait the default 5 s after the restart.
        app[GATEWAY].response_affinity.outage_s = 0.1
        return app

    async with serve(gateway()) as url_a, serve(gateway()) as url_b:
        a, b = (
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            for url in (url_a, url_b)
        )
        try:
            redis_server.stop()
            first = await a.responses.create(
                model="sim-model", input="a conversation begins", max_output_tokens=2
            )
            follow = await a.responses.create(
                model="sim-model", input="go on", previous_response_id=first.id,
                max_output_tokens=2,
            )
            assert follow.previous_response_id == first.id
            with pytest.raises(openai.APIStatusError) as refused:
                await b.responses.create(
                    model="sim-model", input="go on", previous_response_id=first.id,
                    max_output_tokens=2,
                )
            assert refused.value.status_code == 503
            assert refused.value.response.headers["Retry-After"] == "1"
            assert refused.value.body["code"] == "response_lookup_unavailable"

            redis_server.start()  # same port, empty
            # Gateway A writes what the outage kept back on its own, with no request to do it.
            store = redis.asyncio.Redis.from_url(redis_server.url)
            try:
                await wait_until(
                    lambda: store.exists(f"fleetgate:response:{first.id}"),
                    "gateway A wrote the response it recorded during the outage",
                )
            finally:
                await store.aclose()
            await asyncio.sleep(0.2)  # past gateway B's outage_s
            via_b = await b.responses.create(
                model="sim-model", input="go on", previous_response_id=first.id,
                max_output_tokens=2,
            )
            assert via_b.previous_response_id == first.id
            assert (await b.responses.retrieve(first.id)).id == first.id
        finally:
            await a.close()
            await b.close()
