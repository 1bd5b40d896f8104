"""Redis behind Sentinel (``redis+sentinel://``): real ``redis-server`` primaries, replicas and
Sentinels. Every client fleetgate makes follows the primary the Sentinels name, before and after
they promote a replica (a SIGKILL of the primary), with passwords from the environment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
from redis.asyncio import Redis

from bench.local_redis import LocalRedisSentinel
from replica.fleet_store import RedisFleetStore
from replica.vllm_plugin import redis_store
from replica.vllm_plugin.keys import PluginKeys
from routing.index.factory import build_index
from routing.index.redis_client import connect
from routing.redis_clients import bounded_client
from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


@pytest.fixture
def sentinel() -> Iterator[LocalRedisSentinel]:
    group = LocalRedisSentinel(replicas=1, sentinels=1).start()
    try:
        yield group
    finally:
        group.stop()


async def _port_of(client: Redis) -> int:
    """The port of the server ``client`` is talking to (its own ``INFO``)."""
    return int((await client.info("server"))["tcp_port"])


async def _replicated(client: Redis) -> None:
    """Wait until the write before is on a replica: a failover keeps what was replicated."""
    assert await client.execute_command("WAIT", 1, 5000) >= 1


async def test_a_bounded_client_follows_the_primary_through_a_failover(
    sentinel: LocalRedisSentinel,
) -> None:
    client = bounded_client(sentinel.url, 1.0)
    try:
        first = sentinel.primary_port()
        assert await _port_of(client) == first
        await client.set("fg-sentinel:k", "before")
        await _replicated(client)

        promoted = await asyncio.to_thread(sentinel.kill_primary)

        async def answers() -> bytes | None:
            # A call while the old primary's connection breaks fails, as any call does while
            # Redis is down (one retry at once); the next goes to the promoted replica.
            for _ in range(50):
                try:
                    return await client.get("fg-sentinel:k")
                except redis.ConnectionError:
                    await asyncio.sleep(0.1)
            return None

        assert await answers() == b"before"
        assert promoted != first and await _port_of(client) == promoted
        await client.set("fg-sentinel:k", "after")  # a primary again: writes are taken
        assert await client.get("fg-sentinel:k") == b"after"
    finally:
        await client.aclose()
    # Closing it closed its connections to the Sentinels too (they asked where the primary is).
    asked = [c for s in client.sentinel.sentinels for c in s.connection_pool._available_connections]
    assert asked and not any(c.is_connected for c in asked)


async def test_passwords_of_the_primary_and_of_the_sentinels_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = LocalRedisSentinel(password="Pr/m+1=", sentinel_password="Se/nt+2=").start()
    try:
        monkeypatch.setenv("FG_TEST_PRIMARY_PASSWORD", "Pr/m+1=")
        monkeypatch.setenv("FG_TEST_SENTINEL_PASSWORD", "Se/nt+2=")
        nodes = ",".join(f"127.0.0.1:{p}" for p in group.sentinel_ports)
        url = (
            f"redis+sentinel://:${{FG_TEST_PRIMARY_PASSWORD}}@{nodes}/{group.service}/0"
            "?sentinel_password=${FG_TEST_SENTINEL_PASSWORD}"
        )
        for client in (bounded_client(url, 1.0), connect(url)):
            try:
                assert await client.ping()
            finally:
                await client.aclose()

        # The primary's password is not the Sentinels': without theirs, no primary is found.
        wrong = url.split("?")[0]
        client = bounded_client(wrong, 1.0)
        try:
            with pytest.raises(redis.ConnectionError, match=group.service):
                await client.ping()
        finally:
            await client.aclose()
    finally:
        group.stop()


async def test_the_fleet_store_and_the_index_work_through_sentinel(
    sentinel: LocalRedisSentinel,
) -> None:
    store = RedisFleetStore(sentinel.url, key_prefix="fg-sentinel:")
    index = build_index(sentinel.url, mode="lookup", key_prefix="fg-sentinel-idx")
    replica = ReplicaId("pool-a/r0")
    try:
        await store.register(
            ReplicaState(replica_id=replica, url="http://127.0.0.1:1", pool="pool-a"), ttl_s=30
        )
        assert [r.replica_id for r in await store.list_replicas()] == [replica]
        await index.set_epoch(replica, Epoch(1))
        await index.record(replica, Epoch(1), [11, 12, 13])
        await index.heartbeat(replica, 30)
        assert await index.match([11, 12, 13, 14]) == {replica: 3}
    finally:
        await store.close()
        await index.close()


def test_the_engine_plugins_synchronous_client_follows_a_failover(
    sentinel: LocalRedisSentinel,
) -> None:
    client = redis_store.connect(sentinel.url, timeout_s=1.0)
    keys = PluginKeys("fg-sentinel:", "r0")
    store = redis_store.RedisStateStore(client, keys, ttl_s=30)
    try:
        store.write_engine({"state": "serving"})
        assert client.execute_command("WAIT", 1, 5000) >= 1
        promoted = sentinel.kill_primary()
        written = False
        for _ in range(50):  # the publisher retries on its own cadence; so does this loop
            try:
                store.write_engine({"state": "serving again"})
                written = True
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        assert written
        assert int(client.info("server")["tcp_port"]) == promoted
        assert client.hget(keys.engine(0), "state") == b"serving again"
    finally:
        client.close()
