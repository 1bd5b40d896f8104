"""Helpers for the adapter-registry integration tests (no tests here)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from replica.sim.fleet import SimReplicaHandle


async def eventually(condition: Callable[[], Any], timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` (sync or awaitable) is true; fail after ``timeout_s``.

    A bound on waiting, never an assertion about timing: a correct program passes however slow
    the machine is, up to the bound.
    """

    async def poll() -> None:
        while True:
            value = condition()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


async def served_adapters(session: aiohttp.ClientSession, url: str) -> list[str]:
    """Adapters a (simulated) vLLM lists in ``/v1/models``, in load order."""
    async with session.get(f"{url}/v1/models") as resp:
        body = await resp.json()
    return [m["id"] for m in body["data"] if m.get("parent")]


def load_call_counter() -> tuple[aiohttp.TraceConfig, list[str]]:
    """A trace config for a gateway's session, and the load-API URLs it has called."""
    calls: list[str] = []

    async def on_start(
        session: aiohttp.ClientSession, ctx: Any, params: aiohttp.TraceRequestStartParams
    ) -> None:
        if params.url.path == "/v1/load_lora_adapter":
            calls.append(str(params.url))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    return trace, calls


def count_engine_loads(handle: SimReplicaHandle) -> list[str]:
    """Record every adapter load the simulated engine performs (its own load path)."""
    loads: list[str] = []
    engine = handle.replica.engine
    original = engine.load_adapter

    def counting(name: str, size_mb: float | None = None) -> float:
        loads.append(name)
        return original(name, size_mb)

    engine.load_adapter = counting  # type: ignore[method-assign]
    return loads
