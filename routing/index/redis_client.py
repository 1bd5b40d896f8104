"""The index's Redis client from a URL: one server, or a Redis Cluster (``redis+cluster://``).

The mirrored index (``index.mode: mirror``) spreads its keys over ``shards`` hash tags, one Cluster
slot each (``stream_layout``), so on a Cluster its writes spread over the primaries. A URL with
the ``redis+cluster://`` (or ``rediss+cluster://``) scheme names one or more nodes of the Cluster,
comma-separated (``redis+cluster://redis-0:6379,redis-1:6379``); the client asks them (in an
order of redis-py's choosing) until one answers, learns the others from it and routes each
command to the primary that owns its slot. More than one seed lets a gateway or agent start
while a node is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline

from routing.hosts import url_host
from routing.redis_clients import ENV_REFERENCE, expand_env, single_node_client
from routing.redis_sentinel import is_sentinel_url, sentinel_client
from routing.redis_urls import MAX_CONNECTIONS, split_node_list_url

__all__ = [
    "CLUSTER_SCHEMES",
    "IndexRedis",
    "check_cluster_url",
    "cluster_seed_nodes",
    "connect",
    "is_cluster_url",
]

#: Cluster URL scheme -> the scheme redis-py's Cluster client takes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

#: What the index's Redis calls go through: one server's client or a Cluster's.
IndexRedis = aioredis.Redis | aioredis.RedisCluster

_DEFAULT_PORT = 6379


def is_cluster_url(url: str) -> bool:
    """True for a ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme in CLUSTER_SCHEMES


def cluster_seed_nodes(url: str) -> list[tuple[str, int]]:
    """The nodes a Cluster URL names, in order. ``ValueError`` naming the bad one, or if none."""
    return split_node_list_url(url).nodes(_DEFAULT_PORT)


def check_cluster_url(url: str) -> str:
    """``url`` if every node it names reads (``${NAME}`` references, expanded only when
    connecting, stand for any value); ``ValueError`` naming the one that does not."""
    cluster_seed_nodes(ENV_REFERENCE.sub("1", url))
    return url


def connect(url: str, **options: Any) -> IndexRedis:
    """A client for ``url`` (``${NAME}`` expanded from the environment): a ``RedisCluster`` for
    a cluster URL (every node it names a seed, tried until one answers), the primary its
    Sentinels name for a Sentinel URL (``routing/redis_sentinel.py``), else a ``Redis``.

    ``options`` are client settings both take (timeouts, ``retry``).
    """
    url = expand_env(url)
    if is_sentinel_url(url):
        return sentinel_client(url, **options)
    if not is_cluster_url(url):
        return single_node_client(url, **options)
    scheme, userinfo, _, tail = split_node_list_url(url)
    nodes = cluster_seed_nodes(url)
    first_host, first_port = nodes[0]
    # Every seed is passed, the URL's own node too (redis-py adds it after the others); each
    # takes the URL's credentials and TLS settings.
    return WaitingCluster.from_url(
        f"{CLUSTER_SCHEMES[scheme]}://{userinfo}{url_host(first_host)}:{first_port}{tail}",
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        # Per node (redis-py's default: 100); WaitingCluster keeps its calls within it.
        **{"max_connections": MAX_CONNECTIONS, **options},
    )


#: Set while a task runs a call of a ``WaitingCluster``: the calls redis-py makes inside it (a
#: pipeline's redirected commands) ride on the outer call's turn, or they could wait on each other.
_IN_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fleetgate_cluster_call", default=False
)


class WaitingCluster(aioredis.RedisCluster):
    """A Cluster client whose calls wait for a turn once ``max_connections`` of them run.

    redis-py's Cluster client refuses a call at once when a node's pool is full
    (``MaxConnectionsError``), and every gateway feature took that for an outage: token budgets
    stopped being enforced in a burst, speculative writes were dropped (the load review; a
    plain Redis client waits, ``BlockingConnectionPool``). A call (a command, or a pipeline's
    execution) holds at most one connection per node, so at most ``max_connections`` calls at
    once never fill a node's pool. A caller waits for a turn up to its socket timeout (5 s
    without one), then gets a ``ConnectionError`` saying why.
    """

    _turns: asyncio.Semaphore | None = None

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold one of the client's ``max_connections`` turns for a call."""
        if _IN_CALL.get():
            yield
            return
        kwargs = self.get_connection_kwargs()
        if self._turns is None:  # made in the loop that uses the client
            self._turns = asyncio.Semaphore(int(kwargs.get("max_connections") or MAX_CONNECTIONS))
        timeout = kwargs.get("socket_timeout") or 5.0
        try:
            await asyncio.wait_for(self._turns.acquire(), timeout)
        except TimeoutError:
            raise aioredis.ConnectionError(
                f"No Redis Cluster connection free within {timeout:g} s: "
                f"{kwargs.get('max_connections')} calls of this client are running "
                "(max_connections)"
            ) from None
        token = _IN_CALL.set(True)
        try:
            yield
        finally:
            _IN_CALL.reset(token)
            self._turns.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.turn():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:  # as redis-py's own
            return super().pipeline(transaction, shard_hint)
        return _WaitingPipeline(self, transaction)


class _WaitingPipeline(ClusterPipeline):
    """A ``WaitingCluster``'s pipeline: its execution takes one of the client's turns."""

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        client = self.cluster_client
        assert isinstance(client, WaitingCluster)
        async with client.turn():
            return await super().execute(*args, **kwargs)
