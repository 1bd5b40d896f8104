"""Redis clients for calls that something waits on: a request, a health round, a loop's turn.

redis-py's defaults suit a batch job, not a gateway: no connect timeout (a host that drops
packets holds a connect for the OS's SYN timeout, about two minutes) and up to ten retries with
backoff (a Redis that refuses connections costs seconds per call). A client from
``bounded_client`` connects and reads within ``timeout_s`` and retries once, at once (a pooled
connection the server closed is replaced without failing the call), so an outage costs a caller
at most about two timeouts and the caller's own fallback takes over.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = [
    "ENV_REFERENCE",
    "bounded_client",
    "bounded_options",
    "expand_env",
    "has_literal_password",
    "redacted",
]

#: ``${NAME}`` in a Redis URL: the value of that environment variable, read when connecting.
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(url: str, env: Mapping[str, str] | None = None) -> str:
    """``url`` with every ``${NAME}`` replaced by that environment variable (of ``env``,
    default ``os.environ``), percent-encoded (a generated password holds ``/``, ``+``, ``=``,
    which would break the URL), so a password can come from a Secret while the policy file (a
    ConfigMap, logs, ``/admin/policy``) shows only the reference. ``ValueError`` naming the
    variable if one is not set."""
    from urllib.parse import quote

    environ = os.environ if env is None else env

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ValueError(
                f"the Redis URL names ${{{name}}}, which is not set in this process's "
                "environment (set it, e.g. from a Kubernetes Secret)"
            )
        return quote(environ[name], safe="")

    return ENV_REFERENCE.sub(value, url)


def redacted(url: str) -> str:
    """``url`` with a written-out password replaced by ``***``, for logs and admin answers."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.password or ENV_REFERENCE.fullmatch(parts.password):
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def has_literal_password(url: str) -> bool:
    """True if ``url`` carries a password written out (not a ``${NAME}`` reference)."""
    from urllib.parse import urlsplit

    password = urlsplit(url).password
    return bool(password) and not ENV_REFERENCE.fullmatch(password or "")


def bounded_options(timeout_s: float) -> dict[str, Any]:
    """Client settings: connect and every read within ``timeout_s``, one immediate retry (for
    any client constructor, a Cluster's included)."""
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1),
    }


def bounded_client(url: str, timeout_s: float, **options: Any) -> Redis:
    """A client for ``url`` (``${NAME}`` expanded, ``expand_env``) with
    ``bounded_options(timeout_s)``; ``options`` go to ``Redis.from_url``."""
    return Redis.from_url(expand_env(url), **bounded_options(timeout_s), **options)
