"""Real headless Chromium driven over the DevTools protocol (CDP), with aiohttp's websocket.

Debian's ``chromium`` package (``bash tests/setup_chromium.sh``). A test that needs it fails,
naming the install command, when it is missing: it never skips. The page's console errors,
uncaught exceptions and failed loads are collected from the moment the page is attached.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

CHROMIUM = Path("/usr/bin/chromium")
INSTALL = "bash tests/setup_chromium.sh  (apt-get install -y chromium)"
#: Flags that work as root in a container: no sandbox, no GPU, nothing phoning home.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)


def require_chromium() -> Path:
    """The browser binary; the test fails (never skips) with the install command if missing."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install it with `{INSTALL}`")
    return CHROMIUM


@dataclass
class Page:
    """One page target: ``call`` a CDP method; ``problems`` are console errors and exceptions."""

    ws: aiohttp.ClientWebSocketResponse
    problems: list[str] = field(default_factory=list)
    _pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _next_id: int = 0
    _loaded: asyncio.Event = field(default_factory=asyncio.Event)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self.ws.send_json({"id": self._next_id, "method": method, "params": params})
        async with asyncio.timeout(30):
            return await future

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (awaiting it if it is a promise)."""
        answer = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in answer:
            raise AssertionError(f"{expression!r} threw: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    async def navigate(self, url: str) -> None:
        """Load ``url`` and wait for its load event."""
        self._loaded.clear()
        answer = await self.call("Page.navigate", url=url)
        assert "errorText" not in answer, f"navigating to {url}: {answer['errorText']}"
        async with asyncio.timeout(30):
            await self._loaded.wait()

    async def screenshot(self, path: Path, width: int) -> bytes:
        """A PNG of the whole page at ``width`` CSS pixels, written to ``path``."""
        # Lay the page out at the final width first: a narrower window wraps it taller.
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=600, deviceScaleFactor=1, mobile=False,
        )
        height = int(await self.evaluate("document.body.scrollHeight"))
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=1, mobile=False,
        )
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        png = base64.b64decode(shot["data"])
        path.write_bytes(png)
        return png

    async def read_forever(self) -> None:
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            self._dispatch(json.loads(message.data))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            future = self._pending.pop(message["id"], None)
            if future is not None and not future.done():
                if "error" in message:
                    future.set_exception(AssertionError(f"CDP error: {message['error']}"))
                else:
                    future.set_result(message.get("result", {}))
            return
        method, params = message.get("method"), message.get("params", {})
        if method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description")) for a in params.get("args", [])]
            self.problems.append(f"console.{params['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            self.problems.append(f"uncaught exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.problems.append(f"browser log error: {entry.get('text')} {entry.get('url', '')}")


@contextlib.asynccontextmanager
async def headless_page() -> AsyncIterator[Page]:
    """Start headless Chromium with a fresh profile and attach to its blank page."""
    binary = require_chromium()
    profile = tempfile.mkdtemp(prefix="fleetgate-chromium-")
    process = await asyncio.create_subprocess_exec(
        str(binary), *FLAGS, f"--user-data-dir={profile}", "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    drain: asyncio.Task[None] | None = None
    try:
        port = await _devtools_port(process)
        # Chromium keeps logging to stderr: drain it, or a full pipe would stall the browser.
        drain = asyncio.create_task(_drain(process))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            page_target = next(t for t in targets if t["type"] == "page")
            async with http.ws_connect(page_target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                reader = asyncio.create_task(page.read_forever())
                try:
                    for domain in ("Page", "Runtime", "Log"):
                        await page.call(f"{domain}.enable")
                    yield page
                finally:
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reader
    finally:
        if drain is not None:
            drain.cancel()
        if process.returncode is None:
            process.terminate()
            try:
                async with asyncio.timeout(10):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        shutil.rmtree(profile, ignore_errors=True)


async def _devtools_port(process: asyncio.subprocess.Process) -> int:
    """The port of Chromium's ``DevTools listening on ws://127.0.0.1:PORT/…`` line."""
    assert process.stderr is not None
    seen: list[str] = []
    async with asyncio.timeout(60):
        while True:
            line = (await process.stderr.readline()).decode(errors="replace")
            if not line:
                raise AssertionError("chromium exited before DevTools listened:\n" + "".join(seen))
            seen.append(line)
            if match := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                return int(match.group(1))


async def _drain(process: asyncio.subprocess.Process) -> None:
    assert process.stderr is not None
    while await process.stderr.read(65536):
        pass
