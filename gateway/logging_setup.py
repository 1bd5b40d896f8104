"""One logging setup for every long-running fleetgate command."""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

#: Every fleetgate process logs in this format (agents and gateways alike).
LOG_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"

#: Libraries that log one line per HTTP call at INFO: useful when debugging, noise otherwise.
_CHATTY_LOGGERS = ("httpx", "httpcore", "aiohttp.access")


def configure_logging(level: str | int = logging.INFO) -> None:
    """Log to stderr as ``TIME LEVEL logger: message`` (UTC, ms: lines of gateways and agents
    line up in an incident), keeping per-request library chatter quiet."""
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT)
    for handler in logging.getLogger().handlers:  # UTC on fleetgate's handler, not on every one
        if handler.formatter is not None and handler.formatter._fmt == LOG_FORMAT:
            handler.formatter.converter = time.gmtime
    quiet_level = logging.DEBUG if logging.getLogger().level <= logging.DEBUG else logging.WARNING
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(quiet_level)


class _RedactMalformedRequests(logging.Filter):
    """Turn aiohttp's "Error handling request" records for malformed HTTP (an oversized header,
    a bad request line) into one DEBUG line without the offending bytes or a traceback.

    aiohttp logs such a request at ERROR with its parser's message, which quotes the first bytes
    of the offending line: an ``Authorization`` header too long to parse put the API key in the
    log, and any client could fill the log with tracebacks. The client got its 400 already.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg = "refused a malformed HTTP request from %s: %s (HTTP %s)"
        record.args = (remote, type(exc).__name__, exc.code)
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return HTTP_SERVER_LOG.isEnabledFor(logging.DEBUG)


#: The logger the gateway's HTTP server (aiohttp's request handler) logs to, in place of
#: ``aiohttp.server``: malformed requests are redacted and kept to DEBUG, everything else (a
#: failure in the server itself) passes as aiohttp logs it.
HTTP_SERVER_LOG = logging.getLogger("gateway.http_server")
HTTP_SERVER_LOG.addFilter(_RedactMalformedRequests())
