"""Redis clients for calls that something waits on: a request, a health round, a loop's turn.

redis-py's defaults suit a batch job, not a gateway: no connect timeout (a host that drops
packets holds a connect for the OS's SYN timeout, about two minutes) and up to ten retries with
backoff (a Redis that refuses connections costs seconds per call). A client from
``bounded_client`` connects and reads within ``timeout_s`` and retries once, at once (a pooled
connection the server closed is replaced without failing the call), so an outage costs a caller
at most about two timeouts and the caller's own fallback takes over.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = ["bounded_client", "bounded_options"]


def bounded_options(timeout_s: float) -> dict[str, Any]:
    """Client settings: connect and every read within ``timeout_s``, one immediate retry (for
    any client constructor, a Cluster's included)."""
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1),
    }


def bounded_client(url: str, timeout_s: float, **options: Any) -> Redis:
    """A client for ``url`` with ``bounded_options(timeout_s)``; ``options`` go to
    ``Redis.from_url``."""
    return Redis.from_url(url, **bounded_options(timeout_s), **options)
