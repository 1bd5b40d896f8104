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

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from routing.redis_env import ENV_REFERENCE, SECRET_OPTION, expand_env
from routing.redis_sentinel import is_sentinel_url, sentinel_client
from routing.redis_urls import MAX_CONNECTIONS

__all__ = [
    "ENV_REFERENCE",
    "bounded_client",
    "bounded_options",
    "expand_env",
    "has_literal_password",
    "redacted",
]

def _literal(value: str) -> bool:
    return bool(value) and not ENV_REFERENCE.fullmatch(value)


def redacted(url: str) -> str:
    """``url`` with every written-out password (the user-info's, and ``password``,
    ``sentinel_password`` or ``ssl_password`` in the query) replaced by ``***``, for logs,
    errors and admin answers."""
    from urllib.parse import urlsplit

    url = SECRET_OPTION.sub(lambda m: m[1] + ("***" if _literal(m[2]) else m[2]), url)
    try:
        parts = urlsplit(url)
    except ValueError:
        # Unreadable (a half-bracketed IPv6 host): hide all the user-info there may be.
        scheme, sep, rest = url.partition("://")
        userinfo, at, after = rest.partition("@")
        return f"{scheme}{sep}***@{after}" if at and "/" not in userinfo else url
    if not _literal(parts.password or ""):
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def has_literal_password(url: str) -> bool:
    """True if ``url`` carries a password written out (not a ``${NAME}`` reference): in its
    user-info, or as ``password``, ``sentinel_password`` or ``ssl_password`` in its query."""
    from urllib.parse import urlsplit

    if any(_literal(m[2]) for m in SECRET_OPTION.finditer(url)):
        return True
    try:
        return _literal(urlsplit(url).password or "")
    except ValueError:
        return "@" in url.partition("://")[2].split("/", 1)[0]


def single_node_client(url: str, **options: Any) -> Redis:
    """A client of one Redis (not a Cluster, not Sentinel) whose calls wait for a free
    connection, up to their socket timeout, once ``MAX_CONNECTIONS`` are busy, rather than fail.
    ``options`` as for ``Redis.from_url``; a ``max_connections`` in the URL's query wins."""
    wait_s = options.get("socket_timeout") or 5.0
    pool = BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=wait_s, **options
    )
    return Redis.from_pool(pool)


def bounded_options(timeout_s: float) -> dict[str, Any]:
    """Client settings: connect and every read within ``timeout_s``, one immediate retry (for
    any client constructor, a Cluster's included)."""
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1),
    }


def bounded_client(url: str, timeout_s: float, **options: Any) -> Redis:
    """A client for ``url`` (``${NAME}`` expanded, ``expand_env``; a Sentinel URL gives a client
    of the primary its Sentinels name, ``routing/redis_sentinel.py``) with
    ``bounded_options(timeout_s)``; ``options`` go to ``Redis.from_url``."""
    url = expand_env(url)
    if is_sentinel_url(url):
        return sentinel_client(url, **bounded_options(timeout_s), **options)
    return single_node_client(url, **bounded_options(timeout_s), **options)
