"""One logging setup for every long-running fleetgate command."""

from __future__ import annotations

import logging

#: Libraries that log one line per HTTP call at INFO: useful when debugging, noise otherwise.
_CHATTY_LOGGERS = ("httpx", "httpcore", "aiohttp.access")


def configure_logging(level: str | int = logging.INFO) -> None:
    """Log to stderr as ``LEVEL logger: message``, keeping per-request library chatter quiet."""
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    quiet_level = logging.DEBUG if logging.getLogger().level <= logging.DEBUG else logging.WARNING
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(quiet_level)
