"""``build_index``: one place that turns configuration into a ``BlockIndex`` backend."""

from __future__ import annotations

from typing import Any

from routing.contracts import BlockIndex

__all__ = ["DEFAULT_INDEX_MODE", "INDEX_MODES", "build_index"]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


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
    ``clock``, ``require_heartbeat``); a ``redis://``, ``rediss://`` or ``unix://`` URL gives a
    ``RedisBlockIndex`` in ``lookup`` mode (``opts``: ``key_prefix``, ``timeout_s``,
    ``block_ttl_s``, ...) or a ``MirrorBlockIndex`` in ``mirror`` mode (``opts``: ``key_prefix``,
    ``shards``, ``timeout_s``, ``max_entries``, ...).
    """
    if mode not in INDEX_MODES:
        raise ValueError(f"index mode must be one of {', '.join(INDEX_MODES)} (got {mode!r})")
    if url is None or url in ("", "memory"):
        from routing.index.memory import MemoryBlockIndex

        return MemoryBlockIndex(**opts)
    if isinstance(url, str) and url.startswith(_REDIS_SCHEMES):
        if mode == "mirror":
            from routing.index.mirror import MirrorBlockIndex

            return MirrorBlockIndex(url, **opts)
        from routing.index.redis_backend import RedisBlockIndex

        return RedisBlockIndex(url, **opts)
    raise ValueError(
        f"index url must be 'memory' or a redis://, rediss:// or unix:// URL (got {url!r})"
    )
