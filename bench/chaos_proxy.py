"""A small asyncio TCP fault proxy for the chaos benchmark (``bench.chaos``).

One ``FaultProxy`` listens on a loopback port and relays every connection to one upstream
(a replica, Redis). Its mode can change at any moment and applies to the bytes not yet
delivered, in both directions:

- ``pass``: relay as they come;
- ``stall``: hold every byte (connections stay open, nothing moves) until the mode changes; the
  held bytes are then delivered, as TCP delivers them after a network partition heals;
- ``delay``: each chunk from the upstream is delivered ``delay_ms`` after it arrived (a slow
  Redis: one reply per call, so about ``delay_ms`` per call);
- ``scale``: the upstream's answer is stretched ``factor`` times: a reply chunk that came ``d``
  seconds after the last request bytes is delivered ``factor × d`` after them (a slow engine:
  time to first token and every token gap ``factor`` × longer);
- ``refuse``: new connections are closed at once (existing ones keep working).

``drop_all()`` closes every open connection (a network reset). Each direction has a reader task
that timestamps chunks into a queue and a writer task that delivers them, so a held or delayed
chunk never delays the reading (and timing) of the next one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import signal
import time
from dataclasses import dataclass, field

from aiohttp import web

_CHUNK = 65536


class Mode(enum.Enum):
    PASS = "pass"
    STALL = "stall"
    DELAY = "delay"
    SCALE = "scale"
    REFUSE = "refuse"


@dataclass
class ProxyStats:
    """Counters a fault's report can quote."""

    accepted: int = 0
    refused: int = 0
    dropped: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass(eq=False)  # kept in a set: identity, not field equality
class _Conn:
    """One relayed connection: the client side, the upstream side, when the client last spoke."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    last_request_at: float = field(default_factory=time.monotonic)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    """Relay ``127.0.0.1:port`` to ``upstream_host:upstream_port`` under a controllable fault."""

    def __init__(self, name: str, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.name = name
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.mode = Mode.PASS
        self.delay_ms = 0.0
        self.factor = 1.0
        self.stats = ProxyStats()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        # Set whenever the mode changes, so held chunks re-check what to do.
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ control

    def set_mode(self, mode: Mode, *, delay_ms: float = 0.0, factor: float = 1.0) -> None:
        self.mode, self.delay_ms, self.factor = mode, delay_ms, factor
        self._changed.set()
        self._changed = asyncio.Event()

    def heal(self) -> None:
        self.set_mode(Mode.PASS)

    def drop_all(self) -> None:
        """Close every open connection now (both sides see a reset/EOF)."""
        for conn in list(self._conns):
            self._close(conn)
            self.stats.dropped += 1

    @property
    def url_host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    async def start(self, port: int = 0) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_all()
        for conn in list(self._conns):
            for task in conn.tasks:
                task.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    # ------------------------------------------------------------------ relaying

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode is Mode.REFUSE:
            self.stats.refused += 1
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream_host, self.upstream_port), 5.0
            )
        except (OSError, TimeoutError):
            # The upstream is down: the client sees its connection close, as it would
            # see a refused connection through a real load balancer.
            writer.close()
            return
        self.stats.accepted += 1
        conn = _Conn(client=writer, upstream=up_writer)
        self._conns.add(conn)
        up_queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        down_queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        conn.tasks = [
            asyncio.create_task(self._read(conn, reader, up_queue, upstream=True)),
            asyncio.create_task(self._write(conn, up_queue, up_writer, upstream=True)),
            asyncio.create_task(self._read(conn, up_reader, down_queue, upstream=False)),
            asyncio.create_task(self._write(conn, down_queue, writer, upstream=False)),
        ]
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the benchmark is stopping: nothing to relay any more
        finally:
            self._close(conn)

    async def _read(
        self, conn: _Conn, reader: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes]], *, upstream: bool,
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                now = time.monotonic()
                if upstream and data:
                    conn.last_request_at = now
                await queue.put((now, data))
                if not data:
                    return
        except (OSError, asyncio.IncompleteReadError):
            await queue.put((time.monotonic(), b""))

    async def _write(
        self, conn: _Conn, queue: asyncio.Queue[tuple[float, bytes]],
        writer: asyncio.StreamWriter, *, upstream: bool,
    ) -> None:
        try:
            while True:
                arrived, data = await queue.get()
                await self._hold(conn, arrived, upstream=upstream)
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                if upstream:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
        except OSError:
            self._close(conn)

    async def _hold(self, conn: _Conn, arrived: float, *, upstream: bool) -> None:
        """Wait as long as the current mode says this chunk must wait (re-checked on change)."""
        for _ in range(1_000_000):  # bounded: each pass either returns or waits for a change
            changed = self._changed
            wait_s = self._wait_s(conn, arrived, upstream=upstream)
            if wait_s is not None and wait_s <= 0:
                return
            try:
                await asyncio.wait_for(changed.wait(), wait_s)
            except TimeoutError:
                return

    def _wait_s(self, conn: _Conn, arrived: float, *, upstream: bool) -> float | None:
        """Seconds left before this chunk may go; None: until the mode changes."""
        if self.mode is Mode.STALL:
            return None
        if upstream:
            return 0.0  # delay and scale act on the answers only
        now = time.monotonic()
        if self.mode is Mode.DELAY:
            return arrived + self.delay_ms / 1000.0 - now
        if self.mode is Mode.SCALE:
            start = conn.last_request_at
            return start + self.factor * max(0.0, arrived - start) - now
        return 0.0

    def _close(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        for writer in (conn.client, conn.upstream):
            with contextlib.suppress(Exception):
                writer.close()


# --------------------------------------------------------------------------- a process of them
#
# The benchmark runs its proxies in a process of their own, so the load generator's and the
# index reader's work never delays a relayed byte (a Redis call has a 20 ms budget).


@dataclass
class ProxySpec:
    """``name=LISTEN_PORT:UPSTREAM_PORT`` on the command line."""

    name: str
    listen_port: int
    upstream_port: int

    @classmethod
    def parse(cls, text: str) -> ProxySpec:
        name, _, ports = text.partition("=")
        listen, _, upstream = ports.partition(":")
        return cls(name, int(listen), int(upstream))

    def arg(self) -> str:
        return f"{self.name}={self.listen_port}:{self.upstream_port}"


def _control_app(proxies: dict[str, FaultProxy]) -> web.Application:
    """``POST /mode {"name", "mode", "delay_ms", "factor"}``, ``POST /drop {"name"}``."""

    async def mode(request: web.Request) -> web.Response:
        body = await request.json()
        proxy = proxies[body["name"]]
        proxy.set_mode(Mode(body["mode"]), delay_ms=float(body.get("delay_ms", 0.0)),
                       factor=float(body.get("factor", 1.0)))
        return web.json_response({"ok": True})

    async def drop(request: web.Request) -> web.Response:
        proxies[(await request.json())["name"]].drop_all()
        return web.json_response({"ok": True})

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response({name: {"mode": p.mode.value, **dataclasses.asdict(p.stats)}
                                  for name, p in proxies.items()})

    app = web.Application()
    app.router.add_post("/mode", mode)
    app.router.add_post("/drop", drop)
    app.router.add_get("/stats", stats)
    return app


async def serve_proxies(specs: list[ProxySpec], control_port: int, max_s: float) -> None:
    """Run ``specs`` and the control API until SIGINT/SIGTERM or ``max_s`` (a bound)."""
    proxies = {}
    for spec in specs:
        proxies[spec.name] = await FaultProxy(spec.name, spec.upstream_port).start(
            spec.listen_port)
    runner = web.AppRunner(_control_app(proxies), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control_port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max_s)
    for proxy in proxies.values():
        await proxy.stop()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fault proxies for bench.chaos")
    parser.add_argument("--proxy", action="append", default=[], type=ProxySpec.parse,
                        help="NAME=LISTEN_PORT:UPSTREAM_PORT (repeatable)")
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--max-s", type=float, default=7200.0, help="stop after this anyway")
    args = parser.parse_args(argv)
    asyncio.run(serve_proxies(args.proxy, args.control_port, args.max_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
