"""The index's Redis client from a URL: one server, or a Redis Cluster (``redis+cluster://``).

The mirrored index (``index.mode: mirror``) spreads its keys over ``shards`` hash tags, one Cluster
slot each (``stream_layout``), so on a Cluster its writes spread over the primaries. A URL with
the ``redis+cluster://`` (or ``rediss+cluster://``) scheme names any one node of the Cluster; the
client discovers the others and routes each command to the primary that owns its slot.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from routing.redis_clients import expand_env

__all__ = ["CLUSTER_SCHEMES", "IndexRedis", "connect", "is_cluster_url"]

#: Cluster URL scheme -> the scheme redis-py's Cluster client takes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

#: What the index's Redis calls go through: one server's client or a Cluster's.
IndexRedis = aioredis.Redis | aioredis.RedisCluster


def is_cluster_url(url: str) -> bool:
    """True for a ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme in CLUSTER_SCHEMES


def connect(url: str, **options: Any) -> IndexRedis:
    """A client for ``url`` (``${NAME}`` expanded from the environment): a ``RedisCluster`` for
    a cluster URL, else a ``Redis``.

    ``options`` are client settings both take (timeouts, ``retry``).
    """
    url = expand_env(url)
    if is_cluster_url(url):
        scheme, _, rest = url.partition("://")
        return aioredis.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}", **options)
    return aioredis.Redis.from_url(url, **options)
