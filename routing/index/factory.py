"""``build_index``: one place that turns configuration into a ``BlockIndex`` backend."""

from __future__ import annotations

from typing import Any

from routing.contracts import BlockIndex

__all__ = ["build_index"]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def build_index(url: str | None = None, **opts: Any) -> BlockIndex:
    """Build the index that ``url`` names.

    ``None``, ``""`` or ``"memory"`` give a ``MemoryBlockIndex`` (``opts``: ``max_entries``,
    ``clock``, ``require_heartbeat``); a ``redis://``, ``rediss://`` or ``unix://`` URL gives a
    ``RedisBlockIndex`` (``opts``: ``key_prefix``, ``timeout_s``, ``block_ttl_s``, ...).
    """
    if url is None or url in ("", "memory"):
        from routing.index.memory import MemoryBlockIndex

        return MemoryBlockIndex(**opts)
    if isinstance(url, str) and url.startswith(_REDIS_SCHEMES):
        from routing.index.redis_backend import RedisBlockIndex

        return RedisBlockIndex(url, **opts)
    raise ValueError(
        f"index url must be 'memory' or a redis://, rediss:// or unix:// URL (got {url!r})"
    )
