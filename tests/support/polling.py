"""Bounded polling for "eventually" conditions in tests (never a timed assertion)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
) -> None:
    """Poll ``predicate`` (sync or async) until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting until {what}")
        await asyncio.sleep(interval_s)
