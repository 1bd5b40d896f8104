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

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.exceptions import MaxConnectionsError, RedisError

from routing.hosts import url_host
from routing.redis_env import ENV_REFERENCE
from routing.redis_urls import MAX_CONNECTIONS, check_url_options, split_node_list_url

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SENTINEL_PORT",
    "PRIMARY_CHECK_S",
    "SENTINEL_SCHEMES",
    "PrimaryMoves",
    "SentinelPrimary",
    "SentinelUrl",
    "check_primary_url",
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
#: Socket timeouts of the Sentinel connections: the caller's, at most this (seconds).
SENTINEL_TIMEOUT_S = 1.0
#: How often a client asks the Sentinels whether the primary moved (seconds; see
#: ``SentinelPrimary``).
PRIMARY_CHECK_S = 1.0
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


def check_primary_url(url: str) -> str:
    """``url`` if it can name one primary, as read wherever a Redis URL is (the policy file, the
    CLI, the agent, the engine plugin): its query options, and a Sentinel URL's nodes and service
    (``${NAME}`` references stand for any value); ``ValueError`` saying what does not read."""
    check_url_options(url)
    return check_sentinel_url(url) if is_sentinel_url(url) else url


def _client_settings(
    spec: SentinelUrl, options: dict[str, Any], *, sync: bool = False
) -> tuple[dict, dict]:
    """(the primary's connection settings, the Sentinels'): the caller's ``options`` (timeouts,
    ``retry``), then the URL's own (which win, as in ``Redis.from_url``)."""
    primary: dict[str, Any] = {
        "max_connections": MAX_CONNECTIONS, **options, **spec.options, "db": spec.db
    }
    if spec.username:
        primary["username"] = spec.username
    if spec.password:
        primary["password"] = spec.password
    # The Sentinels answer one short question each: the same timeouts (a second without any),
    # and TLS with the same certificates when the URL asks for TLS; not the primary's
    # credentials or database. Each is asked once, no retry: the next Sentinel is the retry
    # (redis-py's default, retries with backoff, held every call seconds on a dead first one).
    sentinels = {k: v for k, v in primary.items() if k.startswith(("socket_", "ssl_"))}
    # At most a second each: a hung Sentinel must not hold a client with a long timeout (the
    # mirror's bulk reads) for its whole timeout before the next Sentinel is asked.
    timeout = min(sentinels.get("socket_timeout") or SENTINEL_TIMEOUT_S, SENTINEL_TIMEOUT_S)
    connect = sentinels.get("socket_connect_timeout") or timeout
    sentinels["socket_timeout"], sentinels["socket_connect_timeout"] = timeout, min(
        connect, SENTINEL_TIMEOUT_S
    )
    sentinels["retry"] = _no_retry(sync)
    if spec.tls:
        primary["ssl"] = sentinels["ssl"] = True
    if spec.sentinel_username:
        sentinels["username"] = spec.sentinel_username
    if spec.sentinel_password:
        sentinels["password"] = spec.sentinel_password
    return primary, sentinels


def _no_retry(sync: bool) -> Any:
    from redis.backoff import NoBackoff

    if sync:
        from redis.retry import Retry
    else:
        from redis.asyncio.retry import Retry
    return Retry(NoBackoff(), 0)


class _Asking:
    """One round of asking the Sentinels, in order, where the primary is: their answers judged
    as redis-py judges them, and, when none names it, an error of one short line per Sentinel
    (redis-py's embeds each client's repr, kilobytes of it) with what to do about the likely
    causes."""

    def __init__(self, manager: Any, service: str) -> None:
        self._manager = manager
        self._service = service
        self._asked: list[str] = []

    def answer(self, number: int, sentinel: Any, masters: dict | RedisError) -> Any:
        """The primary's ``(host, port)`` if Sentinel ``number`` named it, else None."""
        kwargs = sentinel.connection_pool.connection_kwargs
        node = f"{url_host(str(kwargs.get('host')))}:{kwargs.get('port')}"
        if isinstance(masters, RedisError):
            self._asked.append(f"{node} {type(masters).__name__}: {masters}")
            return None
        state = masters.get(self._service)
        if state and self._manager.check_master_state(state, self._service):
            # The one that answered is asked first next time (as redis-py does).
            sentinels = self._manager.sentinels
            sentinels[0], sentinels[number] = sentinel, sentinels[0]
            return state["ip"], state["port"]
        if state:
            self._asked.append(f"{node} sees it down or not a primary")
        else:
            monitored = sorted(masters) or "nothing"
            self._asked.append(f"{node} monitors {monitored}, not {self._service!r}")
        return None

    def failure(self) -> MasterNotFoundError:
        hints = []
        if any("uthentication" in line or "NOAUTH" in line for line in self._asked):
            hints.append("Sentinels that require a password take ?sentinel_password=${NAME}")
        if any("monitors" in line for line in self._asked):
            hints.append("the service is the name in the Sentinels' 'sentinel monitor NAME ...'")
        hint = f" ({'; '.join(hints)})" if hints else ""
        return MasterNotFoundError(
            f"the Sentinels named no primary for service {self._service!r}: "
            f"{'; '.join(self._asked)}{hint}"
        )


class _Sentinels(Sentinel):
    """redis-py's Sentinel manager with short, actionable errors."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        asking = _Asking(self, service_name)
        for number, sentinel in enumerate(self.sentinels):
            try:
                masters = await sentinel.sentinel_masters()
            except RedisError as exc:
                masters = exc
            if (found := asking.answer(number, sentinel, masters)) is not None:
                return found
        raise asking.failure()


class _PrimaryPool(SentinelConnectionPool):
    """The primary's connection pool: every connection it hands out talks to the primary the
    Sentinels named last, and it counts the times that primary moved.

    redis-py's pool closes only the idle connections when it learns of a move; a connection in
    use went back to the pool, and out again, still talking to the old primary (the diff review:
    a busy client sent 7,281 of 7,281 calls there after a ``SENTINEL FAILOVER``). And a move
    learned by a broken connection reconnecting (a crash failover) went uncounted."""

    moves = 0
    #: Callers waiting for a connection once ``max_connections`` are in use (made on first use:
    #: the pool may be built outside the loop that uses it).
    _released: asyncio.Condition | None = None
    #: Callers waiting for a connection now.
    _waiting: int = 0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        """A connection; once ``max_connections`` are in use, one released within the socket
        timeout (5 s without one), as a plain Redis client waits (``BlockingConnectionPool``).
        redis-py's Sentinel pool refuses at once, and every gateway feature took the refusal for
        an outage: token budgets stopped being enforced in a burst (the load review)."""
        if not self._waiting:  # callers already waiting go first (else they could starve)
            try:
                return await super().get_connection(*args, **kwargs)
            except MaxConnectionsError:
                pass
        timeout = self.connection_kwargs.get("socket_timeout") or 5.0
        deadline = time.monotonic() + timeout
        released = self._released = self._released or asyncio.Condition()
        self._waiting += 1
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise redis.ConnectionError(
                        f"No Redis connection free within {timeout:g} s: all "
                        f"{self.max_connections} of this client's are in use (max_connections)"
                    )
                async with released:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(released.wait_for(self.can_get_connection), left)
                try:
                    return await super().get_connection(*args, **kwargs)
                except MaxConnectionsError:
                    continue  # taken by another caller in between: wait again
        finally:
            self._waiting -= 1

    async def release(self, connection: Any) -> None:
        await super().release(connection)
        released = self._released
        if released is not None:
            async with released:
                released.notify()

    async def get_master_address(self) -> Any:
        address = await self.sentinel_manager.discover_master(self.service_name)
        # Compared after the await, so that of two callers asking at once (a reconnect and the
        # background check) one learns of the move and counts it.
        before = self.master_address
        if before != address:
            self.master_address = address
            await self.disconnect(inuse_connections=False)
            if before is not None:
                self.moves += 1
                logger.info(
                    "Redis primary for %r is now %s:%s (was %s:%s)",
                    self.service_name, url_host(str(address[0])), address[1],
                    url_host(str(before[0])), before[1],
                )
        return address

    async def ensure_connection(self, connection: Any) -> None:
        address = self.master_address
        if (
            address is not None
            and connection.is_connected
            and (connection.host, connection.port) != tuple(address)
        ):
            await connection.disconnect()  # it reconnects to the primary named now
        await super().ensure_connection(connection)


class SentinelPrimary(aioredis.Redis):
    """A client of the primary that Sentinels name.

    redis-py asks the Sentinels only when it opens a connection, so after a graceful failover
    (``SENTINEL FAILOVER``: the old primary answers writes until it is told to replicate) the
    pooled connections went on writing to the old primary for seconds, and those writes were
    lost (Sentinel review). So at most every ``PRIMARY_CHECK_S`` a call also asks, in the
    background (a Sentinel outage must not fail or slow a call to a healthy primary); when the
    primary moved, no connection goes to the old one again (``_PrimaryPool``), and
    ``primary_changes`` counts it: writers that may have lost writes re-record
    (``PrimaryMoves``). Closing the client also closes its connections to the Sentinels.
    """

    sentinel: Sentinel | None = None
    _checked_at: float = -math.inf
    _check: asyncio.Task[None] | None = None

    @property
    def primary_changes(self) -> int:
        """Times this client saw the primary move."""
        pool = self.connection_pool
        return pool.moves if isinstance(pool, _PrimaryPool) else 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self._maybe_check_primary()
        return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        self._maybe_check_primary()
        return super().pipeline(transaction, shard_hint)

    def _maybe_check_primary(self) -> None:
        now = time.monotonic()
        if self.sentinel is None or now - self._checked_at < PRIMARY_CHECK_S:
            return
        if self._check is not None and not self._check.done():
            return
        self._checked_at = now
        self._check = asyncio.get_running_loop().create_task(self._check_primary())

    async def _check_primary(self) -> None:
        with contextlib.suppress(RedisError):  # Sentinels out of reach: what we have still works
            await self.connection_pool.get_master_address()

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            if self._check is not None:
                self._check.cancel()
                with contextlib.suppress(asyncio.CancelledError, RedisError):
                    await self._check
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinel is not None:
                for client in self.sentinel.sentinels:
                    with contextlib.suppress(RedisError, OSError):
                        await client.aclose()


class PrimaryMoves:
    """Whether a writer's client saw its primary move since the writer last asked: its writes
    since the move before may have gone to the old primary and be lost, so the writer answers
    its heartbeat as if Redis had forgotten it, and the agent re-records what its engine holds
    (as after a flush). Always False for a client not behind Sentinel."""

    def __init__(self) -> None:
        self._seen = 0

    @staticmethod
    def count(client: object) -> int:
        """The moves ``client`` has seen so far."""
        return client.primary_changes if isinstance(client, SentinelPrimary) else 0

    @staticmethod
    def watched(client: object) -> bool:
        """Whether ``client`` can see its primary move (it is behind Sentinel)."""
        return isinstance(client, SentinelPrimary)

    def check(self, client: object) -> bool:
        changes = self.count(client)
        moved, self._seen = changes != self._seen, changes
        return moved

    def settle(self, count: int) -> None:
        """The moves up to ``count`` (read before a write that declared a new epoch, after which
        everything is recorded again) need no re-record of their own: answering the next
        heartbeat as forgotten for them re-recorded every block twice after a failover (the
        failover review)."""
        self._seen = max(self._seen, count)


def sentinel_client(url: str, **options: Any) -> SentinelPrimary:
    """An asyncio client of the primary ``url`` names (``${NAME}`` already expanded), with
    ``options`` (timeouts, ``retry``) on its connections. Nothing connects until the first
    call."""
    spec = parse_sentinel_url(url)
    primary, sentinels = _client_settings(spec, options)
    sentinel = _Sentinels(list(spec.sentinels), sentinel_kwargs=sentinels)
    client = sentinel.master_for(
        spec.service, redis_class=SentinelPrimary, connection_pool_class=_PrimaryPool, **primary
    )
    client.sentinel = sentinel
    return client


class _SyncPrimary(redis.Redis):
    """``SentinelPrimary``'s synchronous twin: at most every ``PRIMARY_CHECK_S`` a call first
    asks the Sentinels which server is primary (one short question, at most a second each), and
    on a move the pool drops its idle connections so the call goes to the new one.

    Without it a graceful ``SENTINEL FAILOVER`` left the engine plugin writing to the demoted
    primary, which takes writes until Sentinel reconfigures it (~10 s): its state and kernel keys
    aged out on the real primary and a kernel-gated route answered 503 (the failover review). A
    crash failover needs no check: the broken connection asks the Sentinels again."""

    _checked_at: float = -math.inf

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self._check_primary()
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        self._check_primary()
        return super().pipeline(transaction, shard_hint)

    def _check_primary(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < PRIMARY_CHECK_S:
            return
        self._checked_at = now
        with contextlib.suppress(RedisError):  # Sentinels away: the primary known stays
            self.connection_pool.get_master_address()


def sentinel_sync_client(url: str, **options: Any) -> redis.Redis:
    """``sentinel_client``'s synchronous twin (``redis.Redis``), for code off the event loop
    (the engine plugin), following a graceful failover within ``PRIMARY_CHECK_S`` of its next
    call (``_SyncPrimary``)."""
    from redis.sentinel import Sentinel as SyncSentinel

    class SyncSentinels(SyncSentinel):
        def discover_master(self, service_name: str) -> tuple[str, int]:
            asking = _Asking(self, service_name)
            for number, sentinel in enumerate(self.sentinels):
                try:
                    masters = sentinel.sentinel_masters()
                except RedisError as exc:
                    masters = exc
                if (found := asking.answer(number, sentinel, masters)) is not None:
                    return found
            raise asking.failure()

    spec = parse_sentinel_url(url)
    primary, sentinels = _client_settings(spec, options, sync=True)
    sentinel = SyncSentinels(list(spec.sentinels), sentinel_kwargs=sentinels)
    return sentinel.master_for(spec.service, redis_class=_SyncPrimary, **primary)
