"""A host as it goes into a URL or a ZeroMQ endpoint (``http://[::1]:8000``, ``tcp://[::1]:5557``)."""

from __future__ import annotations

__all__ = ["is_ipv6", "url_host"]


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 literal, bracketed or not."""
    return ":" in host.strip("[]")


def url_host(host: str) -> str:
    """``host`` ready to be followed by ``:PORT``: an IPv6 literal in brackets, once."""
    return f"[{host}]" if is_ipv6(host) and not host.startswith("[") else host
