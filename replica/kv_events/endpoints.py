"""Which side of a KV-event stream binds and which connects, by vLLM's rule.

vLLM's publisher *binds* an endpoint that contains a wildcard (``tcp://*:5557``), an IPv6 ``::``,
or an ``ipc://``/``inproc://`` address, and *connects* to anything else (``tcp://gw:5557``);
the subscriber must then do the opposite.
"""

from __future__ import annotations

import zmq

from routing.hosts import is_ipv6, url_host


def publisher_binds(endpoint: str) -> bool:
    """Whether a vLLM publisher given ``endpoint`` binds it (else it connects)."""
    return (
        "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    )


def tcp_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint, an IPv6 address without its brackets;
    None for ipc/inproc."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None
    host = rest.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_ipv6_endpoint(endpoint: str) -> bool:
    """Whether ``endpoint`` names an IPv6 address: its ZeroMQ socket needs the ``IPV6``
    option, without which libzmq refuses to bind it ("No such device") and never connects."""
    host = tcp_host(endpoint)
    return host is not None and is_ipv6(host)


def allow_ipv6(socket: zmq.Socket, endpoint: str) -> None:
    """Set ZeroMQ's ``IPV6`` option on ``socket`` if ``endpoint`` names an IPv6 address."""
    if is_ipv6_endpoint(endpoint):
        socket.setsockopt(zmq.IPV6, 1)


#: Hosts that mean "every interface" to a subscriber that binds.
_WILDCARD_HOSTS = ("*", "::", "0.0.0.0")


def subscriber_binds(endpoint: str) -> bool:
    """Whether a subscriber given ``endpoint`` should bind it (else it connects).

    A subscriber binds only a wildcard address (``tcp://*:5557``, ``tcp://[::]:5557``): that is
    the address it offers to publishers configured to connect to it. Any other address, an
    IPv6 one such as ``tcp://[fd00::5]:5557`` included, is a publisher's to connect to.
    """
    return tcp_host(endpoint) in _WILDCARD_HOSTS


def subscriber_endpoint_for(publisher_endpoint: str, host: str = "127.0.0.1") -> str:
    """The endpoint a subscriber should use for a publisher configured with ``publisher_endpoint``.

    ``tcp://*:5557`` (publisher binds every interface) -> ``tcp://HOST:5557`` (connect);
    ``tcp://[fd00::5]:5557`` (publisher binds that address) -> the same (connect);
    ``tcp://gw:5557`` (publisher connects) -> ``tcp://*:5557`` (bind); ipc/inproc unchanged.
    """
    if publisher_endpoint.startswith(("ipc://", "inproc://")):
        return publisher_endpoint
    scheme, _, rest = publisher_endpoint.partition("://")
    port = rest.rsplit(":", 1)[-1]
    if publisher_binds(publisher_endpoint):
        if tcp_host(publisher_endpoint) not in _WILDCARD_HOSTS:
            return publisher_endpoint
        host = url_host(host)
        return f"{scheme}://{host}:{port}"
    return f"{scheme}://*:{port}"


def offset_port(endpoint: str, offset: int) -> str:
    """``endpoint`` with its TCP port moved up by ``offset`` (one port per replica or DP rank)."""
    if offset == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + offset}"
