"""Several gateways sharing Redis: in-flight counts, and the Redis block index behind the API."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from unittest.mock import patch

import aiohttp
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.inflight import RedisInflight
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.tasks import inflight_loop
from routing.types import ReplicaId
from tests.integration.test_gateway_support import FakeUpstream, serve
from tests.support.polling import wait_until
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis


async def test_inflight_counts_are_shared_between_gateways(redis_url: str) -> None:
    first, second = RedisInflight(redis_url), RedisInflight(redis_url)
    replica = ReplicaId("pool/0")
    try:
        first.start(replica, 100)
        second.start(replica, 20)
        await first.sync()
        await second.sync()
        assert second.counts()[replica] == (2, 120)
        first.finish(replica, 100)
        await first.sync()
        await second.sync()
        assert second.counts()[replica] == (1, 20)
    finally:
        await first.close()
        await second.close()
    # A closed gateway's counts leave Redis with it.
    third = RedisInflight(redis_url)
    await third.sync()
    assert third.counts().get(replica, (0, 0)) == (0, 0)
    await third.close()


async def test_requests_awaiting_their_first_token_are_shared_between_gateways(
    redis_url: str,
) -> None:
    """Each gateway publishes how many of its requests still wait for their first token; a
    gateway that publishes only (requests, tokens) counts all of its requests as waiting."""
    first, second = RedisInflight(redis_url), RedisInflight(redis_url)
    replica = ReplicaId("pool/0")
    try:
        first.start(replica, 100)
        first.start(replica, 100)
        first.prefilled(replica, 100)
        second.start(replica, 20)
        await first.sync()
        await second.sync()
        await first.sync()
        assert (second.awaiting_prefill(replica), first.awaiting_prefill(replica)) == (2, 2)
        second.prefilled(replica, 20)
        await second.sync()
        await first.sync()
        assert first.awaiting_prefill(replica) == 1
        # A gateway that publishes [requests, tokens] only.
        old = {"seq": 1, "counts": {replica: [3, 30]}}
        await first._redis.hset(first.key, "old-gateway", json.dumps(old))
        await second.sync()
        assert second.counts()[replica] == (6, 130)
        assert second.awaiting_prefill(replica) == 1 + 3
    finally:
        await first._redis.hdel(first.key, "old-gateway")
        await first.close()
        await second.close()


async def test_a_gateway_that_stopped_without_saying_so_is_forgotten_and_nothing_is_scanned(
    redis_url: str,
) -> None:
    """Counts live in one hash per fleet: a sync is one round trip whatever else the Redis holds
    (a SCAN of the whole keyspace took 0.6 s beside 300,000 keys). A gateway killed before it
    could remove its field counts until its field has not changed for ``ttl_s`` on the reader's
    clock (no two machines' clocks are compared), then leaves the hash; a field nobody can read
    is dropped rather than stopping everyone's sync."""
    clock = [1_000.0]
    reader = RedisInflight(redis_url, ttl_s=5.0)
    replica = ReplicaId("pool/0")
    killed = {"seq": 7, "counts": {replica: [5, 500, 5]}}
    commands: list[str] = []
    original = reader._redis.execute_command

    async def counted(*args: object, **kwargs: object) -> object:
        commands.append(str(args[0]).upper())
        return await original(*args, **kwargs)

    try:
        await reader._redis.hset(reader.key, "killed", json.dumps(killed))
        await reader._redis.hset(reader.key, "garbled", "{not json")
        reader._redis.execute_command = counted  # type: ignore[method-assign]
        with patch("gateway.inflight.time.monotonic", lambda: clock[0]):
            await reader.sync()
            assert reader.counts()[replica] == (5, 500)  # alive as far as it can tell
            assert "SCAN" not in commands, commands
            assert not await reader._redis.hexists(reader.key, "garbled")
            clock[0] += 4.0
            await reader.sync()
            assert reader.counts()[replica] == (5, 500)
            clock[0] += 2.0  # unchanged for 6 s: gone
            await reader.sync()
            assert reader.counts().get(replica, (0, 0)) == (0, 0)
        assert not await reader._redis.hexists(reader.key, "killed")
    finally:
        reader._redis.execute_command = original  # type: ignore[method-assign]
        await reader.close()


async def test_inflight_counts_stay_within_their_fleet(redis_url: str) -> None:
    """Two fleets on one Redis (two index key prefixes) never add up each other's counts: the
    e2e failover test once waited a minute for a count to rise because another test's stopped
    gateway still had its key there."""
    ours, theirs = RedisInflight(redis_url, fleet="ours"), RedisInflight(redis_url, fleet="theirs")
    replica = ReplicaId("pool/0")
    try:
        theirs.start(replica, 500)
        await theirs.sync()
        ours.start(replica, 7)
        await ours.sync()
        assert ours.counts()[replica] == (1, 7)
        assert theirs.counts()[replica] == (1, 500)
    finally:
        await ours.close()
        await theirs.close()


async def test_gateway_routes_with_the_redis_index(redis_url: str) -> None:
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        app = create_app(
            GatewayConfig(redis_url=redis_url, admin_key="adm", health_interval_s=3600),
            GatewayPolicy.default([spec]),
        )
        body = {"model": "base-model", "prompt": "a long shared prompt " * 20}
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
            headers = {"Authorization": "Bearer adm"}
            async with http.get(f"{url}/admin/decisions?n=1", headers=headers) as resp:
                (latest,) = (await resp.json())["decisions"]
            async with http.get(f"{url}/admin/index", headers=headers) as resp:
                index = await resp.json()
    assert index["backend"] in ("redis", "mirror") and index["available"] is True
    assert index["redis_url"] == redis_url  # which Redis: the one given (no password here)
    # The second request found the first one's speculative entry in Redis.
    assert latest["explanations"]["r0"]["matched_blocks"] == latest["blocks"] > 0
    assert not latest["degraded"]


async def test_admin_index_says_unavailable_while_a_mirror_cannot_reach_redis(
    redis_server: RedisServer,
) -> None:
    """A mirror refuses lookups while Redis is away (decisions are load-only), so /admin/index
    must not say ``available: true`` then, as it did (the live index review)."""
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        app = create_app(
            GatewayConfig(redis_url=redis_server.url, admin_key="adm", health_interval_s=3600),
            GatewayPolicy.default([spec]),
        )
        headers = {"Authorization": "Bearer adm"}
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:

            async def available() -> bool:
                async with http.get(f"{url}/admin/index", headers=headers) as resp:
                    body = await resp.json()
                assert body["backend"] == "mirror"
                return bool(body["available"])

            await wait_until(available, "the mirror to bootstrap")
            redis_server.stop()

            async def unavailable() -> bool:
                return not await available()

            await wait_until(unavailable, "/admin/index to report the outage")
            body = {"model": "base-model", "prompt": "a long shared prompt " * 20}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200  # served, on load alone
            async with http.get(f"{url}/admin/decisions?n=1", headers=headers) as resp:
                (latest,) = (await resp.json())["decisions"]
            assert latest["degraded"]


async def test_the_sync_loop_ends_when_cancelled_even_if_redis_turns_it_into_an_error(
    redis_url: str,
) -> None:
    """redis-py may raise a connection error where the cancellation of a command in flight
    should have been: the in-flight sync loop must still end, or a gateway's shutdown waits on
    it forever."""
    inflight = RedisInflight(redis_url, gateway_id="g")
    entered = asyncio.Event()

    async def set_until_cancelled(*_args: object, **_kwargs: object) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionError("Connection closed by server.") from None

    class Pipeline:  # what the sync's one round trip goes through
        async def __aenter__(self) -> Pipeline:
            return self

        async def __aexit__(self, *_exc: object) -> None:
            return None

        def __getattr__(self, _command: str) -> object:
            return lambda *args, **kwargs: None

        execute = staticmethod(set_until_cancelled)

    inflight._redis.pipeline = lambda **_kwargs: Pipeline()  # type: ignore[method-assign]

    gw = SimpleNamespace(inflight=inflight)  # the one field the loop reads
    task = asyncio.create_task(inflight_loop(gw))  # type: ignore[arg-type]
    await entered.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=30)
    assert task in done and task.cancelled()
    await inflight.close()


async def test_a_gateway_whose_fleet_store_cannot_be_read_says_so_once_and_answers_503(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Replicas only from agents' registrations, and the Redis they are in unreachable from the
    start (a wrong TLS option is the likeliest way): every request said "model does not exist"
    (TLS review), and the log said "fleet store unavailable" every health interval."""
    from replica.fleet_store import RedisFleetStore
    from tests.support.redis_server import free_port

    caplog.set_level(logging.DEBUG, logger="gateway.tasks")
    redis_server = RedisServer(port=free_port())  # not started yet: nothing listens there
    store = RedisFleetStore(redis_server.url, socket_timeout_s=0.5)
    cfg = GatewayConfig(health_interval_s=0.05)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def warned() -> list[str]:
        return [
            r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "fleet store unavailable" in r.getMessage()
        ]

    async with (
        serve(create_app(cfg, GatewayPolicy.default([]), fleet_store=store)) as url,
        aiohttp.ClientSession() as http,
    ):
        await wait_until(
            lambda: sum("fleet store unavailable" in r.getMessage() for r in caplog.records) >= 3,
            "three failed reads of the fleet store",
            timeout_s=10,
        )
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            status, error = resp.status, (await resp.json())["error"]
        assert status == 503 and error["code"] == "no_healthy_replica"
        assert "fleet store (Redis), which it cannot read" in error["message"]
        assert str(redis_server.port) not in error["message"]  # the fleet's insides stay inside
        assert len(warned()) == 1

        redis_server.start()
        try:
            await wait_until(
                lambda: any("readable again" in r.getMessage() for r in caplog.records),
                "the fleet store is read again",
                timeout_s=10,
            )
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 404  # nobody registered "m": now it is an unknown model
        finally:
            redis_server.stop()


async def test_the_in_flight_sync_says_when_redis_works_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its failure was logged, its end was not: an SRE could not tell from the log whether the
    gateways share their counts again (Sentinel review)."""
    from tests.support.redis_server import free_port

    caplog.set_level(logging.INFO, logger="gateway.inflight")
    server = RedisServer(port=free_port())  # not started: the first sync fails
    inflight = RedisInflight(server.url)
    try:
        await inflight.sync()
        assert any("in-flight sync through Redis failed" in r.getMessage() for r in caplog.records)
        server.start()
        await inflight.sync()
        await inflight.sync()
        back = [r for r in caplog.records if "works again" in r.getMessage()]
        assert len(back) == 1 and back[0].levelname == "INFO"
    finally:
        await inflight.close()
        server.stop()
