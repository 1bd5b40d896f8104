"""Which side of a KV-event stream binds and which connects, by vLLM's rule.

vLLM's publisher *binds* an endpoint that contains a wildcard (``tcp://*:5557``), an IPv6 ``::``,
or an ``ipc://``/``inproc://`` address, and *connects* to anything else (``tcp://gw:5557``);
the subscriber must then do the opposite.
"""

from __future__ import annotations


def publisher_binds(endpoint: str) -> bool:
    """Whether a vLLM publisher given ``endpoint`` binds it (else it connects)."""
    return (
        "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    )


def subscriber_binds(endpoint: str) -> bool:
    """Whether a subscriber given ``endpoint`` should bind it (else it connects).

    A subscriber binds only a wildcard address (``tcp://*:5557``, ``tcp://[::]:5557``): that is
    the address it offers to publishers configured to connect to it.
    """
    return "*" in endpoint or "::" in endpoint


def subscriber_endpoint_for(publisher_endpoint: str, host: str = "127.0.0.1") -> str:
    """The endpoint a subscriber should use for a publisher configured with ``publisher_endpoint``.

    ``tcp://*:5557`` (publisher binds) -> ``tcp://HOST:5557`` (connect);
    ``tcp://gw:5557`` (publisher connects) -> ``tcp://*:5557`` (bind); ipc/inproc unchanged.
    """
    if publisher_endpoint.startswith(("ipc://", "inproc://")):
        return publisher_endpoint
    scheme, _, rest = publisher_endpoint.partition("://")
    port = rest.rsplit(":", 1)[-1]
    if publisher_binds(publisher_endpoint):
        return f"{scheme}://{host}:{port}"
    return f"{scheme}://*:{port}"


def offset_port(endpoint: str, offset: int) -> str:
    """``endpoint`` with its TCP port moved up by ``offset`` (one port per replica or DP rank)."""
    if offset == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + offset}"
