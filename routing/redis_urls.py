"""Redis URLs that name several nodes: a Cluster's seeds, a Sentinel group.

``SCHEME://[userinfo@]host:port,host:port,[::1]:port/rest?query``: the part between ``://`` (and
the user-info) and the first ``/`` or ``?`` is a comma-separated node list, which no URL parser
reads (``urlsplit`` takes it for one host). The Cluster URL (``routing/index/redis_client.py``)
and the Sentinel URL (``routing/redis_sentinel.py``) read it here, the same way.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PRIMARY_URL_PREFIXES", "NodeListUrl", "parse_node", "split_node_list_url"]

#: How URLs of one Redis primary begin: a server's, or a Sentinel group's (which names it). Every
#: Redis client but the block index's takes only these (the index also takes a Cluster's).
PRIMARY_URL_PREFIXES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+sentinel://",
    "rediss+sentinel://",
)


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
