"""Argument types shared by the commands: each refuses a value that cannot work with argparse's
own exit 2 and a message naming the range, before anything starts."""

from __future__ import annotations

import argparse
import errno
import logging
import math
import re
import sys
from collections.abc import Callable


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535; a larger number would wrap silently."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to 65535 (got {value})")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {value})")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (got {value})")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (NaN and infinity are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (NaN and infinity are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return value


def non_empty(text: str) -> str:
    """A name that is not empty or blank (a model name clients will send)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


#: ``--log-level`` values (``logging``'s names), any case.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """One of ``LOG_LEVELS``, any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown level {text!r}; choose from: {', '.join(LOG_LEVELS)}"
        )
    return text.upper()


#: Schemes of a single Redis server's URL (a Cluster holds only the index, named in the policy
#: file: docs/index.md).
REDIS_SCHEMES = ("redis", "rediss", "unix")


def redis_url(url: str) -> str:
    """A single Redis server's URL: ``redis://HOST:PORT/DB`` (or ``rediss://``, ``unix://``),
    with a numeric port; or a Sentinel group's, which names one primary
    (``redis+sentinel://HOST:26379,HOST:26379/SERVICE/DB``)."""
    from urllib.parse import urlsplit

    from routing.redis_clients import redacted
    from routing.redis_sentinel import check_primary_url, is_sentinel_url

    if url.startswith(("redis+cluster://", "rediss+cluster://")):
        raise argparse.ArgumentTypeError(
            f"{redacted(url)}: a Redis Cluster holds the block index only. Give one Redis "
            "server (fleet store, in-flight counts, token budgets) here, and put the Cluster "
            "under the policy's index.redis_url (docs/index.md, Redis Cluster)"
        )
    try:
        check_primary_url(url)
        if is_sentinel_url(url):
            return url
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{redacted(url)}: {exc}") from None
    parts = urlsplit(url)
    hint = f"; did you mean redis://{url}/0?" if "://" not in url else ""
    if parts.scheme not in REDIS_SCHEMES or (parts.scheme != "unix" and not parts.hostname):
        raise argparse.ArgumentTypeError(
            "a Redis URL is redis://HOST:PORT/DB, rediss://HOST:PORT/DB, unix://PATH or, for "
            "Redis behind Sentinel, redis+sentinel://HOST:26379,HOST:26379/SERVICE/DB "
            f"(got {redacted(url)!r}{hint})"
        )
    try:
        parts.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError:
        raise argparse.ArgumentTypeError(f"the port of {redacted(url)!r} is not a number") from None
    return url


def zmq_endpoint(text: str) -> str:
    """A ZeroMQ endpoint as vLLM's KV-event flags take it: ``tcp://HOST:PORT`` (connect),
    ``tcp://*:PORT`` (bind), ``ipc://PATH`` or ``inproc://NAME``."""
    scheme, sep, rest = text.partition("://")
    if sep and scheme in ("ipc", "inproc") and rest:
        return text
    host, colon, number = rest.rpartition(":")
    if scheme == "tcp" and sep and colon and host and number.isdigit():
        if int(number) > 65535:  # ZeroMQ would wrap it silently (99999 bound 34463)
            raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (got {number} in {text!r})")
        return text
    raise argparse.ArgumentTypeError(
        f"a ZeroMQ endpoint is tcp://HOST:PORT (connect), tcp://*:PORT (bind) or ipc://PATH "
        f"(got {text!r})"
    )


def http_url(what: str) -> Callable[[str], str]:
    """An argparse type for an ``http(s)://HOST[:PORT]`` URL of ``what`` (``/`` dropped at
    the end)."""

    def check(url: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # A password in what was typed is not echoed (CI logs keep usage errors).
            shown = re.sub(r"^((?:[a-z+]+://)?[^/@:]+):[^/@]*@", r"\1:***@", url)
            raise argparse.ArgumentTypeError(
                f"{what} is http(s)://HOST:PORT (got {shown!r}; did you mean http://{shown}?)"
            )
        return url.rstrip("/")

    return check


#: PromQL's duration units in seconds, largest first: a range names them in this order, each once.
_PROMQL_UNIT_SECONDS = {
    "y": 31_536_000.0, "w": 604_800.0, "d": 86_400.0, "h": 3_600.0, "m": 60.0, "s": 1.0,
    "ms": 0.001,
}
_PROMQL_PART = re.compile(r"(\d+)(ms|[smhdwy])")


def promql_duration(text: str) -> str:
    """A PromQL range such as ``10m``, ``1h30m`` or ``90s``: units from the largest down, each
    once, and not zero (Prometheus refuses ``1s5m`` and ``0s``; said here, as a usage error)."""
    pattern = "".join(f"(?:\\d+{unit})?" for unit in _PROMQL_UNIT_SECONDS)
    if not text or not re.fullmatch(pattern, text) or not promql_seconds(text):
        raise argparse.ArgumentTypeError(
            "a PromQL duration is a number and a unit, larger units first and not zero, e.g. "
            f"10m, 1h30m, 90s (got {text!r})"
        )
    return text


def promql_seconds(duration: str) -> float:
    """A PromQL duration (as ``promql_duration`` checks it) in seconds."""
    return sum(int(n) * _PROMQL_UNIT_SECONDS[u] for n, u in _PROMQL_PART.findall(duration))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def cannot_start(
    command: str, exc: Exception, where: str | None = None, port_flag: str = "--port"
) -> int:
    """Print why ``command`` could not start (a port in use, a bad setting) in one line on
    stderr, instead of a traceback; returns the exit status 2. ``port_flag``: the flag that
    chooses the port, for the hint."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        message = f"cannot listen on {where}: the port is in use (choose another with {port_flag})"
    elif isinstance(exc, OSError) and where is not None:
        message = f"cannot listen on {where}: {exc.strerror or exc}"
    else:
        message = str(exc)
    print(f"fleetgate {command}: {message}", file=sys.stderr)
    # The traceback, for a bug that surfaced as one of these, at debug level.
    logging.getLogger("fleetgate").debug("fleetgate %s could not start", command, exc_info=exc)
    return 2


def routing_profile(name: str) -> str:
    """A built-in routing profile's name (``--profile`` without a policy file)."""
    from routing.policies.registry import BUILTIN_PROFILES

    if name not in BUILTIN_PROFILES:
        raise argparse.ArgumentTypeError(
            f"unknown routing profile {name!r}; choose from: {', '.join(BUILTIN_PROFILES)}"
        )
    return name


def replica_url(url: str) -> str:
    """An engine's base URL: ``http://`` or ``https://`` and a host. A trailing ``/v1`` (an
    OpenAI client's base URL, which is what ``fleetgate sim`` and vLLM print) is dropped: the
    gateway adds the API's own path, and would otherwise call ``/v1/v1/...``."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"an engine URL is http(s)://HOST:PORT (got {url!r}; did you mean http://{url}?)"
        )
    return strip_api_suffix(url.rstrip("/"))


def strip_api_suffix(url: str) -> str:
    """``url`` without a trailing ``/v1``."""
    return url[: -len("/v1")] if url.lower().endswith("/v1") else url


#: Option names whose defaults ``--help`` never shows.
_SECRET_WORDS = ("key", "secret", "token", "password")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written, and every option's default shown where its help does not say
    it already (argparse's own ``ArgumentDefaultsHelpFormatter`` would repeat those). Never the
    default of a secret (an admin key read from the environment would be printed)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default is None
            or default is False  # a flag (store_true); a default of 0 is shown
            or default is argparse.SUPPRESS
            or default == []
            or not action.option_strings
            or any(word in action.dest for word in _SECRET_WORDS)
        ):
            return action.help
        return f"{text} (default: {default})".lstrip()
