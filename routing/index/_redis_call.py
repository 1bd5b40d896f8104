"""One Redis operation within a time budget, any failure turned into ``IndexUnavailable``.

Shared by the lookup backend (``redis_backend``) and the mirror's stream writer, so both fail
the same way: a scorer that gets ``IndexUnavailable`` routes on load alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from redis.exceptions import RedisClusterException, RedisError

from routing.contracts import IndexUnavailable

_T = TypeVar("_T")


async def call_redis(what: str, timeout_s: float, operation: Awaitable[_T]) -> _T:
    """Await ``operation`` within ``timeout_s``; any Redis, socket or time-out failure is
    ``IndexUnavailable("<what> failed: …")``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await operation
    # ``RedisClusterException`` is not a ``RedisError``: a cluster with every node down raises it.
    except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
        # A time-out carries no message: say what it waited ("TimeoutError: " said nothing).
        detail = str(exc) or f"no answer within {timeout_s:g} s"
        raise IndexUnavailable(f"{what} failed: {type(exc).__name__}: {detail}") from exc
