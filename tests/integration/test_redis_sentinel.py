"""Redis behind Sentinel (``redis+sentinel://``): real ``redis-server`` primaries, replicas and
Sentinels. Every client fleetgate makes follows the primary the Sentinels name, before and after
they promote a replica (a SIGKILL of the primary), with passwords from the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest
import redis
from redis.asyncio import Redis

from bench.local_redis import LocalRedisSentinel
from replica.fleet_store import RedisFleetStore
from replica.vllm_plugin import redis_store
from replica.vllm_plugin.keys import PluginKeys
from routing.contracts import IndexUnavailable
from routing.index.factory import build_index
from routing.index.redis_client import connect
from routing.index.stream_writer import StreamIndexWriter
from routing.redis_clients import bounded_client
from routing.redis_sentinel import PRIMARY_CHECK_S
from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId
from tests.support.polling import wait_until
from tests.support.redis_server import free_port

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
        # Learned by a broken connection reconnecting, the move is counted all the same (it was
        # not: the agent never re-recorded after a crash failover; the diff review).
        assert client.primary_changes == 1
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


@contextlib.contextmanager
def _plugin_store(
    sentinel: LocalRedisSentinel,
) -> Iterator[tuple[redis.Redis, PluginKeys, redis_store.RedisStateStore]]:
    """The engine plugin's synchronous client and state store, through the Sentinels."""
    client = redis_store.connect(sentinel.url, timeout_s=1.0)
    keys = PluginKeys("fg-sentinel:", "r0")
    try:
        yield client, keys, redis_store.RedisStateStore(client, keys, ttl_s=30)
    finally:
        client.close()


def test_the_engine_plugins_synchronous_client_follows_a_failover(
    sentinel: LocalRedisSentinel,
) -> None:
    with _plugin_store(sentinel) as (client, keys, store):
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


def test_the_engine_plugins_synchronous_client_follows_a_graceful_failover(
    sentinel: LocalRedisSentinel,
) -> None:
    # The demoted primary takes writes until the Sentinels reconfigure it (~10 s): the plugin's
    # client kept writing there, its keys aged out on the new primary, and a kernel-gated route
    # answered 503 (the failover review). It now asks the Sentinels once a second.
    with _plugin_store(sentinel) as (client, keys, store):
        store.write_engine({"state": "serving"})
        old = int(client.info("server")["tcp_port"])
        promoted = sentinel.fail_over()  # returns once the Sentinels name the new primary
        # The next write after a check interval goes there, while the old primary would still
        # take it for seconds.
        time.sleep(PRIMARY_CHECK_S + 0.1)
        store.write_engine({"state": "on the new primary"})
        assert promoted != old and int(client.info("server")["tcp_port"]) == promoted
        on_new = redis.Redis(port=promoted)
        try:
            assert on_new.hget(keys.engine(0), "state") == b"on the new primary"
        finally:
            on_new.close()


async def test_a_dead_sentinel_first_in_the_list_costs_one_refused_connect_not_retries(
    sentinel: LocalRedisSentinel,
) -> None:
    """redis-py's default retries with backoff on each Sentinel held every new connection for
    seconds behind a dead first Sentinel (Sentinel review: 0 of 40 lookups within 0.1 s)."""
    dead = free_port()  # nothing listens there
    live = ",".join(f"127.0.0.1:{p}" for p in sentinel.sentinel_ports)
    url = f"redis+sentinel://127.0.0.1:{dead},{live}/{sentinel.service}/0"
    client = bounded_client(url, 0.5)
    try:
        assert all(
            s.connection_pool.connection_kwargs["retry"].get_retries() == 0
            for s in client.sentinel.sentinels  # type: ignore[union-attr]
        )
        # A generous bound: the fault took seconds per connection, a refused connect takes
        # well under one.
        assert await asyncio.wait_for(client.ping(), timeout=5.0)
    finally:
        await client.aclose()


async def test_no_primary_found_says_why_for_each_sentinel_in_one_short_line() -> None:
    group = LocalRedisSentinel(replicas=0, sentinel_password="Se/nt+2=").start()
    dead = free_port()
    nodes = f"127.0.0.1:{group.sentinel_ports[0]},127.0.0.1:{dead}"
    try:
        for url, expected in (
            (f"redis+sentinel://{nodes}/{group.service}", "?sentinel_password="),
            (
                f"redis+sentinel://{nodes}/wrong?sentinel_password=Se%2Fnt%2B2%3D",
                f"monitors ['{group.service}'], not 'wrong'",
            ),
        ):
            client = bounded_client(url, 0.5)
            try:
                with pytest.raises(redis.ConnectionError) as raised:
                    await client.ping()
            finally:
                await client.aclose()
            message = str(raised.value)
            assert expected in message and f"127.0.0.1:{dead} ConnectionError" in message
            assert "<redis" not in message and len(message) < 600, message  # no client reprs
    finally:
        group.stop()


async def test_after_a_graceful_failover_writes_follow_the_new_primary_and_writers_re_record(
    sentinel: LocalRedisSentinel,
) -> None:
    """``SENTINEL FAILOVER``: the old primary answers writes until the Sentinels turn it into a
    replica, and redis-py asks them only for new connections, so pooled connections wrote to it
    for about 11 s and those writes were lost (Sentinel review). The client now asks every
    second, and the index writer tells its agent to re-record."""
    writer = StreamIndexWriter(sentinel.url, key_prefix="fg-sentinel-idx", timeout_s=1.0)
    client = writer.client
    replica = ReplicaId("pool-a/r0")
    try:
        await writer.set_epoch(replica, Epoch(1))
        assert await writer.heartbeat_known(replica, 30)
        old = await _port_of(client)
        promoted = await asyncio.to_thread(sentinel.fail_over)

        async def on_the_new_primary() -> bool:
            return await _port_of(client) == promoted

        await wait_until(on_the_new_primary, "the client follows the failover", timeout_s=10)
        assert promoted != old and client.primary_changes == 1
        # Writes since the move may have gone to the old primary: re-record, once.
        assert not await writer.heartbeat_known(replica, 30)
        assert await writer.heartbeat_known(replica, 30)
    finally:
        await writer.close()


async def test_a_new_epoch_declared_after_the_move_needs_no_second_re_record(
    sentinel: LocalRedisSentinel,
) -> None:
    # After a crash failover the agent's resync declared a new epoch and re-recorded every
    # block on the new primary, then its heartbeat answered "forgotten" for the same move and
    # everything was re-recorded a second time (the failover review).
    writer = StreamIndexWriter(sentinel.url, key_prefix="fg-sentinel-epoch", timeout_s=1.0)
    replica = ReplicaId("pool-a/r0")
    try:
        await writer.set_epoch(replica, Epoch(1))
        assert await writer.heartbeat_known(replica, 30)
        await asyncio.to_thread(sentinel.kill_primary)
        for _ in range(50):  # the resync retries until Redis answers again
            try:
                await writer.set_epoch(replica, Epoch(2))
                break
            except IndexUnavailable:
                await asyncio.sleep(0.1)
        assert writer.client.primary_changes == 1
        assert await writer.heartbeat_known(replica, 30)
    finally:
        await writer.close()


async def test_a_busy_client_leaves_the_old_primary_too(sentinel: LocalRedisSentinel) -> None:
    """Connections in use when the move is learned went back to the pool, and out again, still
    talking to the old primary (diff review: 16 busy tasks, all 16 connections on the old
    primary 4 s after the move)."""
    client = bounded_client(sentinel.url, 1.0)
    stop = asyncio.Event()

    async def busy(n: int) -> None:
        while not stop.is_set():
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                await client.set(f"fg-sentinel:busy:{n}", "x")

    tasks = [asyncio.create_task(busy(n)) for n in range(8)]
    try:
        await wait_until(lambda: client.connection_pool._in_use_connections, "calls in flight")
        promoted = await asyncio.to_thread(sentinel.fail_over)
        await wait_until(lambda: client.primary_changes == 1, "the move is learned", timeout_s=10)
        stop.set()
        await asyncio.gather(*tasks)
        ports = await asyncio.gather(*(_port_of(client) for _ in range(16)))
        assert set(ports) == {promoted}
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()


async def test_a_burst_past_the_pool_waits_for_a_connection_rather_than_fails(
    sentinel: LocalRedisSentinel,
) -> None:
    # redis-py's Sentinel pool refused the call past max_connections at once, and every gateway
    # feature took that for an outage (token budgets stopped being enforced in a burst); a plain
    # Redis client waits for a free connection (tests/integration/test_redis_bursts.py).
    client = bounded_client(f"{sentinel.url}?max_connections=4", 5.0)
    try:
        await asyncio.gather(*(client.incr("fg-sentinel:burst") for _ in range(200)))
        assert await client.get("fg-sentinel:burst") == b"200"
        assert len(client.connection_pool._in_use_connections) == 0
        assert len(client.connection_pool._available_connections) <= 4
    finally:
        await client.aclose()
