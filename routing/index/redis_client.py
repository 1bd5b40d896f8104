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

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode

from routing.hosts import url_host
from routing.redis_clients import ENV_REFERENCE, expand_env

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


def _split_cluster_url(url: str) -> tuple[str, str, str, str]:
    """``(scheme, userinfo@ or "", the node list, the rest from the first / or ?)``."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    return scheme, userinfo + at, hosts, tail


def _parse_node(node: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``host`` (port 6379) as ``(host, port)``."""
    if node.startswith("["):
        host, bracket, after = node[1:].partition("]")
        if not bracket or not host or (after and not after.startswith(":")):
            raise ValueError(f"cannot read the node {node!r}: write an IPv6 node as [::1]:6379")
        port_text = after[1:]
    else:
        host, _, port_text = node.partition(":")
        if not host:
            raise ValueError(f"the node {node!r} names no host, e.g. redis-0:6379")
    if not port_text:
        return host, _DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"the node {node!r} has no valid port (1-65535)")
    return host, int(port_text)


def cluster_seed_nodes(url: str) -> list[tuple[str, int]]:
    """The nodes a Cluster URL names, in order. ``ValueError`` naming the bad one, or if none."""
    _, _, hosts, _ = _split_cluster_url(url)
    nodes = [_parse_node(node.strip()) for node in hosts.split(",") if node.strip()]
    if not nodes:
        raise ValueError("must name a node, e.g. redis+cluster://redis-0:6379,redis-1:6379")
    return nodes


def check_cluster_url(url: str) -> str:
    """``url`` if every node it names reads (``${NAME}`` references, expanded only when
    connecting, stand for any value); ``ValueError`` naming the one that does not."""
    cluster_seed_nodes(ENV_REFERENCE.sub("1", url))
    return url


def connect(url: str, **options: Any) -> IndexRedis:
    """A client for ``url`` (``${NAME}`` expanded from the environment): a ``RedisCluster`` for
    a cluster URL (every node it names a seed, tried until one answers), else a ``Redis``.

    ``options`` are client settings both take (timeouts, ``retry``).
    """
    url = expand_env(url)
    if not is_cluster_url(url):
        return aioredis.Redis.from_url(url, **options)
    scheme, userinfo, _, tail = _split_cluster_url(url)
    nodes = cluster_seed_nodes(url)
    first_host, first_port = nodes[0]
    # Every seed is passed, the URL's own node too (redis-py adds it after the others); each
    # takes the URL's credentials and TLS settings.
    return aioredis.RedisCluster.from_url(
        f"{CLUSTER_SCHEMES[scheme]}://{userinfo}{url_host(first_host)}:{first_port}{tail}",
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        **options,
    )
