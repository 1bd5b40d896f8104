"""Redis behind Sentinel: a ``redis+sentinel://`` URL names the Sentinels and the primary's service.

``redis+sentinel://[[user]:password@]sentinel-0:26379[,sentinel-1:26379,...]/SERVICE[/DB][?options]``

``SERVICE`` is the name the Sentinels monitor (``sentinel monitor SERVICE ...``; Bitnami's chart
calls it ``mymaster``). The client asks the Sentinels, in the order given, until one says where
that service's primary is, connects there, and asks again whenever a connection to it fails or
the server answers that it is now a replica: after a failover, calls go to the promoted replica
(a call that was in flight during it fails, as any call does while Redis is down, and the caller's
fallback takes it). The user and password are the primary's. ``rediss+sentinel://`` speaks TLS to
the Sentinels and the primary alike.

Options in the query are the connection's, as for ``redis://`` (``ssl_ca_certs=/etc/redis/ca.pem``,
``socket_timeout=1``), and two are the Sentinels' own: ``sentinel_username`` and
``sentinel_password``, for Sentinels that require authentication (``requirepass`` in
``sentinel.conf``); ``${NAME}`` references work there as in the password.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from routing.redis_env import ENV_REFERENCE
from routing.redis_urls import split_node_list_url

__all__ = [
    "DEFAULT_SENTINEL_PORT",
    "SENTINEL_SCHEMES",
    "SentinelUrl",
    "check_sentinel_url",
    "is_sentinel_url",
    "parse_sentinel_url",
    "sentinel_client",
    "sentinel_sync_client",
]

#: Sentinel URL scheme -> whether it speaks TLS.
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
#: Sentinel's own port (``redis-sentinel``'s default).
DEFAULT_SENTINEL_PORT = 26379

_EXAMPLE = "redis+sentinel://sentinel-0:26379,sentinel-1:26379/mymaster/0"
#: Query options that are the Sentinels' own, not the primary's connection's.
_SENTINEL_AUTH = ("sentinel_username", "sentinel_password")


def is_sentinel_url(url: str) -> bool:
    """True for a ``redis+sentinel://`` or ``rediss+sentinel://`` URL."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme in SENTINEL_SCHEMES


@dataclass(frozen=True)
class SentinelUrl:
    """What a Sentinel URL names."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    #: The primary's connection options from the query, typed as redis-py types them.
    options: dict[str, Any] = field(default_factory=dict)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """``url`` read; ``ValueError`` saying what is missing or wrong, with an example."""
    if not is_sentinel_url(url):
        raise ValueError(f"a Sentinel URL starts with redis+sentinel://, e.g. {_EXAMPLE}")
    parts = split_node_list_url(url)
    nodes = parts.nodes(DEFAULT_SENTINEL_PORT)
    path, _, query = parts.tail.partition("?")
    names = [unquote(p) for p in path.split("/") if p]
    if not names:
        raise ValueError(
            "names no service: put the name the Sentinels monitor (sentinel monitor NAME ...) "
            f"after the nodes, e.g. {_EXAMPLE}"
        )
    if len(names) > 2 or (len(names) == 2 and not names[1].isdigit()):
        raise ValueError(
            f"after the nodes comes /SERVICE or /SERVICE/DB with a numeric DB, e.g. {_EXAMPLE} "
            f"(got {path!r})"
        )
    pairs = parse_qsl(query, keep_blank_values=True)
    own = {key: value for key, value in pairs if key in _SENTINEL_AUTH}
    user, _, password = parts.userinfo.removesuffix("@").partition(":")
    return SentinelUrl(
        sentinels=tuple(nodes),
        service=names[0],
        db=int(names[1]) if len(names) == 2 else 0,
        tls=SENTINEL_SCHEMES[parts.scheme],
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_username=own.get("sentinel_username") or None,
        sentinel_password=own.get("sentinel_password") or None,
        options=_connection_options([(k, v) for k, v in pairs if k not in _SENTINEL_AUTH]),
    )


def _connection_options(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Query options typed by redis-py's own URL parser (so they mean what they mean in a
    ``redis://`` URL); ``ValueError`` naming a bad one."""
    if not pairs:
        return {}
    parsed = redis.connection.parse_url(f"redis://localhost?{urlencode(pairs)}")
    return {key: value for key, value in parsed.items() if key not in ("host", "port", "db")}


def check_sentinel_url(url: str) -> str:
    """``url`` if it reads as a Sentinel URL (``${NAME}`` references, expanded only when
    connecting, stand for any value); ``ValueError`` saying what does not."""
    parse_sentinel_url(ENV_REFERENCE.sub("1", url))
    return url


def _client_settings(spec: SentinelUrl, options: dict[str, Any]) -> tuple[dict, dict]:
    """(the primary's connection settings, the Sentinels'): the caller's ``options`` (timeouts,
    ``retry``), then the URL's own (which win, as in ``Redis.from_url``)."""
    primary: dict[str, Any] = {**options, **spec.options, "db": spec.db}
    if spec.username:
        primary["username"] = spec.username
    if spec.password:
        primary["password"] = spec.password
    # The Sentinels answer one short question each: the same timeouts, and TLS with the same
    # certificates when the URL asks for TLS; not the primary's credentials, database or retry.
    sentinels = {k: v for k, v in primary.items() if k.startswith(("socket_", "ssl_"))}
    if spec.tls:
        primary["ssl"] = sentinels["ssl"] = True
    if spec.sentinel_username:
        sentinels["username"] = spec.sentinel_username
    if spec.sentinel_password:
        sentinels["password"] = spec.sentinel_password
    return primary, sentinels


class SentinelPrimary(aioredis.Redis):
    """A client of the primary that Sentinels name; closing it also closes its connections to
    the Sentinels."""

    sentinel: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel is not None:
            for client in self.sentinel.sentinels:
                await client.aclose()


def sentinel_client(url: str, **options: Any) -> SentinelPrimary:
    """An asyncio client of the primary ``url`` names (``${NAME}`` already expanded), with
    ``options`` (timeouts, ``retry``) on its connections. Nothing connects until the first
    call."""
    spec = parse_sentinel_url(url)
    primary, sentinels = _client_settings(spec, options)
    sentinel = Sentinel(list(spec.sentinels), sentinel_kwargs=sentinels)
    client = sentinel.master_for(spec.service, redis_class=SentinelPrimary, **primary)
    client.sentinel = sentinel
    return client


def sentinel_sync_client(url: str, **options: Any) -> redis.Redis:
    """``sentinel_client``'s synchronous twin (``redis.Redis``), for code off the event loop."""
    from redis.sentinel import Sentinel as SyncSentinel

    spec = parse_sentinel_url(url)
    primary, sentinels = _client_settings(spec, options)
    sentinel = SyncSentinel(list(spec.sentinels), sentinel_kwargs=sentinels)
    return sentinel.master_for(spec.service, **primary)
