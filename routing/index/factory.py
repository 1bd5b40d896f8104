"""``build_index``: one place that turns configuration into a ``BlockIndex`` backend."""

from __future__ import annotations

from typing import Any

from routing.contracts import BlockIndex
from routing.redis_urls import PRIMARY_URL_PREFIXES

__all__ = ["DEFAULT_INDEX_MODE", "INDEX_MODES", "build_index"]

#: A Redis Cluster (``routing/index/redis_client.py``): mirror mode only.
_CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


#: How a Redis-backed index is read: ``lookup`` runs one Redis script per lookup
#: (``RedisBlockIndex``); ``mirror`` keeps a local copy fed by Redis streams
#: (``MirrorBlockIndex``; writers that never look up use ``StreamIndexWriter``).
INDEX_MODES = ("lookup", "mirror")
#: The mode gateways and agents use unless told otherwise (they must agree: agents in lookup
#: mode write the lookup layout, in mirror mode the streams).
DEFAULT_INDEX_MODE = "mirror"


def build_index(
    url: str | None = None, *, mode: str = DEFAULT_INDEX_MODE, **opts: Any
) -> BlockIndex:
    """Build the index that ``url`` and ``mode`` name.

    ``None``, ``""`` or ``"memory"`` give a ``MemoryBlockIndex`` (``opts``: ``max_entries``,
    ``clock``, ``require_heartbeat``); a ``redis://``, ``rediss://`` or ``unix://`` URL (or a
    Sentinel group's, ``redis+sentinel://``: ``routing/redis_sentinel.py``) gives a
    ``RedisBlockIndex`` in ``lookup`` mode (``opts``: ``key_prefix``, ``timeout_s``,
    ``block_ttl_s``, ...) or a ``MirrorBlockIndex`` in ``mirror`` mode (``opts``: ``key_prefix``,
    ``shards``, ``timeout_s``, ``max_entries``, ...). A ``redis+cluster://`` or
    ``rediss+cluster://`` URL (seed nodes of a Redis Cluster) gives a mirror whose shards spread
    over the Cluster's primaries; lookup mode keeps one index in one slot and refuses it.
    """
    if mode not in INDEX_MODES:
        raise ValueError(f"index mode must be one of {', '.join(INDEX_MODES)} (got {mode!r})")
    if url is None or url in ("", "memory"):
        from routing.index.memory import MemoryBlockIndex

        return MemoryBlockIndex(**opts)
    if isinstance(url, str) and url.startswith(_CLUSTER_SCHEMES):
        if mode != "mirror":
            raise ValueError(
                "a Redis Cluster URL needs index mode 'mirror': lookup mode keeps the whole index "
                f"in one hash slot, so a Cluster adds nothing to it (got mode {mode!r})"
            )
        from routing.index.mirror import MirrorBlockIndex

        return MirrorBlockIndex(url, **opts)
    if isinstance(url, str) and url.startswith(PRIMARY_URL_PREFIXES):
        if mode == "mirror":
            from routing.index.mirror import MirrorBlockIndex

            return MirrorBlockIndex(url, **opts)
        from routing.index.redis_backend import RedisBlockIndex

        return RedisBlockIndex(url, **opts)
    from routing.config.errors import describe_value  # here: routing.config imports this module

    raise ValueError(
        "index url must be 'memory', a redis://, rediss:// or unix:// URL, a Sentinel group's "
        "redis+sentinel:// URL, or a Redis Cluster's "
        f"redis+cluster:// or rediss+cluster:// URL (got {describe_value(url)})"
    )
