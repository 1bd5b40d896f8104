"""What fleetgate reads of a Redis URL itself: node lists, and the options in its query.

``SCHEME://[userinfo@]host:port,host:port,[::1]:port/rest?query``: the part between ``://`` (and
the user-info) and the first ``/`` or ``?`` is a comma-separated node list, which no URL parser
reads (``urlsplit`` takes it for one host). The Cluster URL (``routing/index/redis_client.py``)
and the Sentinel URL (``routing/redis_sentinel.py``) read it here, the same way.

The query's options go to redis-py's connections (``?ssl_ca_certs=/etc/redis/ca.pem``). One it
does not know, or a TLS option on a plain URL, fails every connect for ever, so the policy file,
the CLI and the engine plugin refuse them when they read the URL (``check_url_options``), and a
process checks the certificate files it was given when it starts (``check_url_files``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "CONNECTION_OPTIONS",
    "PRIMARY_URL_PREFIXES",
    "SENTINEL_OPTIONS",
    "TLS_FILE_OPTIONS",
    "TLS_OPTIONS",
    "NodeListUrl",
    "check_url_files",
    "check_url_options",
    "parse_node",
    "split_node_list_url",
]

#: How URLs of one Redis primary begin: a server's, or a Sentinel group's (which names it). Every
#: Redis client but the block index's takes only these (the index also takes a Cluster's).
PRIMARY_URL_PREFIXES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+sentinel://",
    "rediss+sentinel://",
)


#: Connections one client opens to one Redis node at most. redis-py 8's asyncio pool refuses the
#: 101st at once ("Too many connections"): a burst of more than 100 requests at one gateway,
#: Redis healthy and idle, switched token budgets off, failed Responses follow-ups with 503 and
#: dropped speculative index writes (the load review). One Redis serves thousands of clients;
#: past this many calls at once a client waits (up to its socket timeout) for a free connection:
#: a plain Redis client's pool and the primary's behind Sentinel block, a Cluster client's calls
#: take turns (``routing/index/redis_client.py``).
MAX_CONNECTIONS = 512


class NodeListUrl(NamedTuple):
    """The parts of a node-list URL, each as written."""

    scheme: str
    #: ``user:password@`` (with its ``@``), or "".
    userinfo: str
    #: The comma-separated nodes.
    hosts: str
    #: Everything from the first ``/`` or ``?`` after the nodes ("" if nothing follows them).
    tail: str

    def nodes(self, default_port: int) -> list[tuple[str, int]]:
        """The nodes, in order; ``ValueError`` naming the one that does not read, or if none."""
        nodes = [parse_node(n.strip(), default_port) for n in self.hosts.split(",") if n.strip()]
        if not nodes:
            example = f"{self.scheme}://redis-0:{default_port},redis-1:{default_port}"
            raise ValueError(f"must name a node, e.g. {example}")
        return nodes


def split_node_list_url(url: str) -> NodeListUrl:
    """``url`` cut into scheme, user-info, node list and the rest."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    return NodeListUrl(scheme, userinfo + at, hosts, tail)


def parse_node(node: str, default_port: int) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``host`` (``default_port``) as ``(host, port)``."""
    if node.startswith("["):
        host, bracket, after = node[1:].partition("]")
        if not bracket or not host or (after and not after.startswith(":")):
            raise ValueError(
                f"cannot read the node {node!r}: write an IPv6 node as [::1]:{default_port}"
            )
        port_text = after[1:]
    else:
        host, _, port_text = node.partition(":")
        if not host:
            raise ValueError(f"the node {node!r} names no host, e.g. redis-0:{default_port}")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"the node {node!r} has no valid port (1-65535)")
    return host, int(port_text)


#: Query options a Redis URL may carry, passed to redis-py's connections as in ``redis://``
#: URLs (an unknown one would reach the connection as a keyword argument and fail every
#: connect with a ``TypeError``, so it is refused up front) ...
CONNECTION_OPTIONS = frozenset(
    {
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "health_check_interval",
        "client_name",
        "max_connections",
        "retry_on_timeout",
        "protocol",
        "db",
        # redis-py documents unix://...?db=0&password=... (a socket has no user-info).
        "username",
        "password",
    }
)
#: ... those that only a TLS URL (``rediss://``, ``rediss+cluster://``, ``rediss+sentinel://``)
#: takes ...
TLS_OPTIONS = frozenset(
    {
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
    }
)
#: ... and those only a Sentinel URL takes (``routing/redis_sentinel.py``).
SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})
#: TLS options that name a file (or, ``ssl_ca_path``, a directory) the connecting process reads.
TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")
_CERT_REQS = ("none", "optional", "required")


def _query_pairs(url: str) -> list[tuple[str, str]]:
    from urllib.parse import parse_qsl

    _, _, rest = url.partition("://")
    query = rest.partition("?")[2].partition("#")[0]
    return parse_qsl(query, keep_blank_values=True)


def check_url_options(url: str) -> None:
    """``ValueError`` naming the first query option of ``url`` that no connection could take:
    unknown (with the nearest known name), TLS-only on a plain URL, Sentinel-only elsewhere,
    or a value redis-py cannot read. ``${NAME}`` references stand for any value."""
    import difflib

    import redis

    scheme = url.partition("://")[0]
    tls, sentinel = scheme.startswith("rediss"), scheme.endswith("+sentinel")
    allowed = CONNECTION_OPTIONS | TLS_OPTIONS | (SENTINEL_OPTIONS if sentinel else frozenset())
    pairs = _query_pairs(url)
    for key, value in pairs:
        if key not in allowed:
            near = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            known = ", ".join(sorted(allowed))
            raise ValueError(f"unknown option {key!r} in the Redis URL{hint}; known: {known}")
        if key in TLS_OPTIONS and not tls:
            raise ValueError(
                f"{key} is a TLS option: use rediss:// (rediss+cluster://, rediss+sentinel://)"
            )
        if key == "db" and sentinel:
            raise ValueError("a Sentinel URL takes its database in the path: /SERVICE/DB")
        # redis-py reads these in lower case only.
        if key == "ssl_cert_reqs" and value not in _CERT_REQS and "${" not in value:
            choices = ", ".join(_CERT_REQS)
            raise ValueError(f"ssl_cert_reqs must be one of {choices} (got {value!r})")
    parsers = redis.connection.URL_QUERY_ARGUMENT_PARSERS
    typed = [(k, v) for k, v in pairs if k in parsers and "${" not in v]
    if typed:
        from urllib.parse import urlencode

        try:
            redis.connection.parse_url(f"redis://localhost?{urlencode(typed)}")
        except ValueError as exc:
            raise ValueError(f"{exc} (the Redis URL's query)") from None


def check_url_files(url: str) -> None:
    """``ValueError`` naming each TLS option of ``url`` (``${NAME}`` already expanded) whose file
    this process cannot read: checked when a process starts, so that a missing certificate is
    told at once, not as an endless 'No such file or directory' connect error."""
    import os

    for key, path in _query_pairs(url):
        if key not in TLS_FILE_OPTIONS:
            continue
        wanted = os.path.isdir if key == "ssl_ca_path" else os.path.isfile
        if not wanted(path) or not os.access(path, os.R_OK):
            what = "directory" if key == "ssl_ca_path" else "file"
            raise ValueError(
                f"{key}={path}: no readable {what} there (the Redis URL's TLS {what}); mount it "
                "into this container, or fix the path"
            )
