"""Short-lived tasks the gateway tracks until they end (index writes, budget charges, adapter
unloads): awaited or cancelled on shutdown, never leaked."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["run_in_background"]


def run_in_background(
    background: set[asyncio.Task[Any]], work: Coroutine[Any, Any, Any], name: str
) -> asyncio.Task[Any]:
    """``work`` as a task tracked in ``background`` (the gateway's ``GatewayState.background``)
    until it ends; needs a running loop (``RuntimeError`` otherwise)."""
    task = asyncio.get_running_loop().create_task(work, name=name)
    background.add(task)
    task.add_done_callback(background.discard)
    return task
