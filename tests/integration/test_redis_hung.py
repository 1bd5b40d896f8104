"""A Redis that accepts connections and never answers (a frozen server, a half-open network):
every Redis client a request or a loop waits on gives up within its bound and the caller's
fallback takes over, on a real socket. Without bounded clients these calls waited for the OS
(connects) or forever (reads on a pooled connection).

The guard of 30 s only stops a hung test; nothing here asserts how long a call took.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import RedisClusterException

from adapters_registry.placement import PlacementUnavailable
from adapters_registry.placement_redis import RedisPlacementStore
from gateway.inflight import RedisInflight
from gateway.response_affinity import (
    RedisResponseAffinity,
    ResponseAffinityUnavailable,
    ResponseHome,
)
from gateway.token_budgets import OUTAGE_S, RedisBudgetStore
from replica.agent.ingest import INDEX_DOWN_ERRORS
from replica.fleet_store import FleetStoreUnavailable, RedisFleetStore
from routing.contracts import IndexUnavailable
from routing.index._redis_call import call_redis
from routing.types import ReplicaId

GUARD_S = 30.0


@pytest.fixture
async def frozen_redis() -> AsyncIterator[str]:
    """A TCP server that reads whatever it is sent and never writes a byte back."""
    connections: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while await reader.read(4096):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_the_adapter_placement_store_gives_up(frozen_redis: str) -> None:
    store = RedisPlacementStore.from_url(frozen_redis, timeout_s=0.2)
    try:
        with pytest.raises(PlacementUnavailable, match=r"no answer within 0\.2 s"):
            await asyncio.wait_for(store.status(ReplicaId("r0"), "ad"), GUARD_S)
    finally:
        await store.close()


async def test_token_budgets_are_not_enforced_rather_than_waited_for(frozen_redis: str) -> None:
    store = RedisBudgetStore(frozen_redis)
    try:
        assert await asyncio.wait_for(store.reserve("k", 10, 100, 60), GUARD_S) is True
        assert await asyncio.wait_for(store.used("k"), GUARD_S) == 0
    finally:
        await store.close()


async def test_token_budgets_leave_a_hung_redis_alone_for_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Each budgeted request waited out two timeouts on a hung Redis (about 2 s added to its
    # TTFT, on every gateway) and logged it; after one failure the store now skips Redis.
    received: list[bytes] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            received.append(data)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    now = [0.0]
    store = RedisBudgetStore(f"redis://127.0.0.1:{port}/0", clock=lambda: now[0])
    try:
        assert await asyncio.wait_for(store.reserve("k", 10, 100, 60), GUARD_S) is True
        sent = len(received)
        assert sent > 0  # the first call did ask
        for _ in range(5):  # within the outage: answered at once, Redis not asked
            assert await asyncio.wait_for(store.reserve("k", 10, 100, 60), GUARD_S) is True
            assert await asyncio.wait_for(store.used("k"), GUARD_S) == 0
            await asyncio.wait_for(store.add("k", 5, 60), GUARD_S)
        assert len(received) == sent
        failures = [r for r in caplog.records if "token budget" in r.getMessage()]
        assert len(failures) == 1 and "not enforced for the next 5 s" in failures[0].getMessage()
        now[0] = OUTAGE_S + 0.1  # the outage window is over: Redis is asked again
        assert await asyncio.wait_for(store.used("k"), GUARD_S) == 0
        assert len(received) > sent
    finally:
        await store.close()
        server.close()
        await server.wait_closed()


async def test_response_affinity_keeps_its_own_and_says_it_cannot_tell_the_rest(
    frozen_redis: str,
) -> None:
    affinity = RedisResponseAffinity(frozen_redis)
    home = ResponseHome(ReplicaId("r0"), "acme")
    try:
        await asyncio.wait_for(affinity.remember("resp_mine", home), GUARD_S)
        assert await asyncio.wait_for(affinity.home_of("resp_mine"), GUARD_S) == home
        with pytest.raises(ResponseAffinityUnavailable):
            await asyncio.wait_for(affinity.home_of("resp_1"), GUARD_S)
    finally:
        await affinity.close()


async def test_inflight_counts_of_other_gateways_expire_through_an_outage(
    frozen_redis: str,
) -> None:
    inflight = RedisInflight(frozen_redis, gateway_id="g1", ttl_s=5.0)
    r0 = ReplicaId("r0")
    try:
        inflight.start(r0, 100)
        # Last read from Redis: another gateway had 40 requests on r0.
        inflight._others = {r0: (40, 4000)}
        await asyncio.wait_for(inflight.sync(), GUARD_S)  # fails, logs, keeps them: fresh
        assert inflight.count(r0) == (41, 4100)
        inflight._synced_at -= 6.0  # that read is now older than the counts' TTL in Redis
        inflight.take_changed()
        await asyncio.wait_for(inflight.sync(), GUARD_S)
        assert inflight.count(r0) == (1, 100)  # our own request only
        assert r0 in inflight.take_changed()  # readers look again
    finally:
        await inflight.close()


async def test_the_fleet_store_reports_unavailable(frozen_redis: str) -> None:
    store = RedisFleetStore(frozen_redis, socket_timeout_s=0.2)
    try:
        with pytest.raises(FleetStoreUnavailable):
            await asyncio.wait_for(store.list_replicas(), GUARD_S)
    finally:
        await store.close()


async def test_a_cluster_with_every_node_down_is_index_unavailable() -> None:
    async def cluster_down() -> None:
        raise RedisClusterException("Redis Cluster cannot be connected. Please provide ...")

    with pytest.raises(IndexUnavailable, match="RedisClusterException"):
        await call_redis("lookup", 1.0, cluster_down())
    # The agent's ingest loops treat it as "the index is down", not as a bug that kills them.
    assert any(issubclass(RedisClusterException, e) for e in INDEX_DOWN_ERRORS)


def test_a_wrong_url_scheme_does_not_print_the_password() -> None:
    from replica.fleet_store import build_fleet_store
    from routing.index.factory import build_index

    url = "http://:s3cret-pass@redis.internal:6379/0"
    for build in (build_fleet_store, build_index):
        with pytest.raises(ValueError) as error:
            build(url)
        assert "s3cret-pass" not in str(error.value)
        assert "redis.internal" in str(error.value)  # the rest still says what was given


@pytest.mark.redis
async def test_a_bounded_client_retries_once_on_a_connection_the_server_closed(
    redis_url: str,
) -> None:
    """The retry must be redis-py's asyncio one: the synchronous ``Retry`` on an asyncio
    client hands back the coroutine unretried, and the kill below would fail the call."""
    from redis.asyncio import Redis

    from routing.redis_clients import bounded_client

    client = bounded_client(redis_url, 2.0)
    admin = Redis.from_url(redis_url)
    try:
        assert await client.ping()
        own_id = await client.client_id()  # the pooled connection the next call reuses
        await admin.client_kill_filter(_id=own_id)
        assert await asyncio.wait_for(client.ping(), GUARD_S)
    finally:
        await client.aclose()
        await admin.aclose()


async def test_the_redis_fleet_store_remembers_a_removal_not_an_expiry(redis_url: str) -> None:
    import uuid

    from replica.fleet_store import RedisFleetStore
    from routing.state import ReplicaState
    from routing.types import ReplicaId

    store = RedisFleetStore(redis_url, key_prefix=f"fg-test-{uuid.uuid4().hex[:8]}:")
    try:
        await store.publish(ReplicaState(replica_id=ReplicaId("a"), url="http://a"), ttl_s=60)
        await store.publish(ReplicaState(replica_id=ReplicaId("b"), url="http://b"), ttl_s=0.05)
        await store.remove(ReplicaId("a"))
        await asyncio.sleep(0.2)  # b's heartbeat expires
        assert await store.list_replicas() == []
        assert await store.departed() == {ReplicaId("a")}
        # Back in the fleet: an earlier clean stop no longer marks it as gone.
        await store.register(ReplicaState(replica_id=ReplicaId("a"), url="http://a"), ttl_s=60)
        assert await store.departed() == set()
    finally:
        await store.close()
