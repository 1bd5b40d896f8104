"""Running a gateway app: one process, or N worker processes sharing the port (SO_REUSEPORT).

Signals: SIGTERM / SIGINT drain and stop (in-flight streams get ``drain_timeout_s``), SIGHUP
reloads the policy file. With workers, the parent forwards both to every worker.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import multiprocessing
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.logging_setup import configure_logging
from gateway.reload import reload_policy
from gateway.state import GATEWAY, GatewayState

log = logging.getLogger(__name__)


def run_event_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(main)`` on uvloop when it is installed (a pinned dependency), else asyncio.

    ``FLEETGATE_UVLOOP=0`` forces the standard loop.
    """
    uvloop: Any = None
    if os.environ.get("FLEETGATE_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            uvloop = None
    if uvloop is None:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def tune_gc() -> None:
    """Garbage collection for a long-running server, once start-up is done.

    Everything allocated so far (modules, the app, the policy) lives as long as the process:
    ``gc.freeze()`` takes it out of every later collection. A request allocates a few hundred
    short-lived container objects, so the youngest generation's threshold is raised from 700 to
    keep collections (and the pauses of the older generations they trigger) rarer.
    """
    gc.collect()
    gc.freeze()
    _gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(20_000, gen1, gen2)


def listening_sockets(host: str, port: int, reuse_port: bool = False) -> list[socket.socket]:
    """Bound, listening TCP sockets for every address ``host`` resolves to, as asyncio's
    ``create_server`` binds them (``""``: every interface, IPv4 and IPv6; ``localhost``: both
    loopbacks); port 0 picks one free port for all. Raises ``OSError`` (``EADDRINUSE`` for a port
    in use), with nothing left open."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    bound: set[tuple[int, str]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in bound:
                continue
            bound.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                # As asyncio: each family on its own socket, so "" can take both.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the port the first one was given
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(128)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    drain_timeout_s: float,
    reuse_port: bool = False,
    idle_timeout_s: float = 75.0,
) -> tuple[web.AppRunner, str]:
    """Start serving ``app``; returns the runner and the URL it listens on.

    The port is bound before the app starts: a port in use (or a wrong host) fails at once, with
    nothing started. Bound after the app's background tasks (health polls, the Redis index
    mirror) had started, the error went unseen on uvloop: cancelled, those tasks did not end,
    and the process hung, deaf to SIGTERM."""
    sockets = listening_sockets(host, port, reuse_port)
    # handler_cancellation: a client disconnect cancels its handler, which aborts the upstream.
    # keepalive_timeout also closes a connection that never completes its headers (nothing
    # sent, or half of them: a slowloris), from aiohttp 3.10 on. aiohttp's shutdown waits its
    # timeout twice for a request still running (for it to end, then after failing its body,
    # which a response being streamed or written does not notice): half the drain each, or a
    # 30 s drain served streams 62 s past SIGTERM, past the pod's grace period.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None,
        shutdown_timeout=drain_timeout_s / 2, keepalive_timeout=idle_timeout_s,
    )
    try:
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock).start()
    except BaseException:
        for sock in sockets:
            sock.close()
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    shown = "127.0.0.1" if bound_host in ("0.0.0.0", "::") else bound_host
    if ":" in shown:  # an IPv6 address: a URL takes it in brackets
        shown = f"[{shown}]"
    return runner, f"http://{shown}:{bound_port}"


async def stop_serving(app: web.Application, runner: web.AppRunner) -> None:
    """Leave the load balancer's rotation, then stop: ``/ready`` 503 for ``stop_delay_s`` while
    requests are still served, then the listener closes and in-flight requests get
    ``drain_timeout_s`` to finish; what is left then is cut (its client sees the stream end)."""
    gw = app[GATEWAY]
    gw.stopping = True
    _close_idle_connections(runner)
    if gw.config.stop_delay_s > 0:
        log.info("stopping: /ready is 503; still serving for %.1f s", gw.config.stop_delay_s)
        await asyncio.sleep(gw.config.stop_delay_s)
    for site in list(runner.sites):
        await site.stop()  # no new connections; those open keep going
    gw.draining = True  # a new request on an open keep-alive connection: 503 shutting_down
    drain_s = gw.config.drain_timeout_s
    if gw.active_requests:
        log.info("stopping: draining %d request(s), at most %g s", gw.active_requests, drain_s)
    # Every request in flight (streams, responses still being written, whatever the route) gets
    # the drain: aiohttp's shutdown, at half the drain twice (``start_site``). Said just before
    # the end what it will cut.
    cut = asyncio.get_running_loop().call_later(max(0.0, drain_s - 0.1), _say_cut, gw, drain_s)
    try:
        await runner.cleanup()
    finally:
        cut.cancel()


def _close_idle_connections(runner: web.AppRunner) -> None:
    """Close idle keep-alive connections now, while the listener still accepts: the client's
    next request opens a new connection and is served (told ``Connection: close``). Kept open,
    they were reused through the whole stop delay and closed at its end, under a request just
    sent on one (lost to "server disconnected" after this gateway had left the rotation). A
    connection with a request in flight is left alone: its answer says ``Connection: close``
    (``close_connections_when_stopping``). Marked closing instead, it dropped the rest of a body
    still being uploaded, and that request hung until the drain cut it (the diff review)."""
    server = runner.server
    if server is None:
        return
    for connection in server.connections:
        # aiohttp's own idle test (``RequestHandler._process_keepalive``): waiting for a request,
        # none received. Its ``pre_shutdown`` only marks idle ones, closed at ``shutdown``.
        waiter = getattr(connection, "_waiter", None)
        if waiter is not None and not waiter.done():
            connection.force_close()


def _say_cut(gw: GatewayState, drain_s: float) -> None:
    if gw.active_requests:
        log.warning(
            "stopping: %d request(s) still running at the end of the %g s drain are cut",
            gw.active_requests, drain_s,
        )


#: Stop signals this close together are one signal delivered twice (``StopSignals._cut``).
SAME_SIGNAL_S = 0.25


class StopSignals:
    """SIGTERM/SIGINT set ``stopped``; SIGHUP reloads the policy. Install before announcing
    readiness, so a signal sent right after the announcement is never lost."""

    def __init__(
        self,
        app: web.Application | None = None,
        on_second: Callable[[], None] | None = None,
    ) -> None:
        self.stopped = asyncio.Event()
        #: A second stop signal came: the stop was cut short.
        self.cut = False
        #: Called on a second stop signal instead of cancelling the waiting task (``fleetgate
        #: up`` exits at once: its simulated replicas would drain their requests first).
        self._on_second = on_second
        self._loop = asyncio.get_running_loop()
        self._stopped_at = math.inf
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._stop)
        if app is not None:
            gw = app[GATEWAY]
            self._loop.add_signal_handler(signal.SIGHUP, lambda: reload_policy(gw))

    async def wait(self) -> None:
        """Block until stopped; from then on a second SIGTERM/SIGINT cancels the task that
        waited (``cut``), cutting its stop short (the stop delay, the drain).

        Restoring Python's default handlers instead left the second signal to uvloop, which
        ran it only when the loop next woke: a second Ctrl-C waited out the stop delay (the
        CLI review)."""
        try:
            await self.stopped.wait()
        finally:
            # Ended by something else than a signal (cancelled): the next signal is a second.
            self._stopped_at = min(self._stopped_at, self._loop.time())
            task = asyncio.current_task()
            self._loop.remove_signal_handler(signal.SIGHUP)
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._cut, task)

    def _stop(self) -> None:
        self._stopped_at = min(self._stopped_at, self._loop.time())
        self.stopped.set()

    def _cut(self, task: asyncio.Task[Any] | None) -> None:
        if self._loop.time() - self._stopped_at < SAME_SIGNAL_S:
            # One signal delivered twice: to the process group (a terminal's Ctrl-C) and
            # forwarded by ``serve --workers``'s parent. Not a second stop.
            return
        self.cut = True
        if self._on_second is not None:
            self._on_second()
        elif task is not None:
            task.cancel()

    def remove(self) -> None:
        """Restore default signal handling (a stop signal stops the process again)."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._loop.remove_signal_handler(sig)


AppFactory = Callable[[GatewayConfig], web.Application]


def _worker(
    factory: AppFactory,
    config: GatewayConfig,
    host: str,
    port: int,
    reuse_port: bool,
    on_ready: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    if reuse_port:
        # A spawned worker starts with no logging set up: ``serve``'s format and level, or its
        # lines come out bare and its INFO lines not at all.
        configure_logging()

    async def main() -> None:
        app = factory(config)
        signals = StopSignals(app)
        try:
            runner, url = await start_site(
                app, host, port, config.drain_timeout_s, reuse_port, config.idle_timeout_s
            )
        except BaseException:
            signals.remove()  # else SIGTERM would only set an event nobody waits for
            raise
        tune_gc()
        if on_ready is not None:
            await on_ready(url)
        try:
            await signals.wait()
        finally:
            try:
                await stop_serving(app, runner)
            except asyncio.CancelledError:
                if not signals.cut:
                    raise
                log.info("stopped at once: a second stop signal cut the stop short")

    # A stop signal that arrives before the loop installs its handlers (still starting up) is a
    # clean stop too, not a traceback and exit code 1.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_event_loop(main())
    except KeyboardInterrupt:
        log.info("stopped during start-up")


def serve_forever(
    factory: AppFactory,
    config: GatewayConfig,
    host: str,
    port: int,
    workers: int = 1,
    on_ready: Callable[[str], Awaitable[None]] | None = None,
) -> int:
    """Serve until stopped. ``workers > 1`` forks that many processes sharing the port."""
    if workers <= 1:
        _worker(factory, config, host, port, False, on_ready)
        return 0
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_worker, args=(factory, config, host, port, True), name=f"fleetgate-worker-{i}"
        )
        for i in range(workers)
    ]

    forwarded: set[int] = set()

    def forward(signum: int, _frame: object) -> None:
        forwarded.add(signum)
        for process in processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signum)

    # Handlers first: a signal during start-up is forwarded, not lost or fatal to the parent.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for process in processes:
        process.start()
    log.info("fleetgate: %d workers on %s:%d (SO_REUSEPORT)", workers, host, port)
    exit_codes = []
    for process in processes:
        process.join()
        exit_codes.append(process.exitcode or 0)
    return workers_exit_code(exit_codes, forwarded)


def workers_exit_code(exit_codes: list[int], forwarded: set[int]) -> int:
    """The command's exit code from its workers': any failure fails it.

    A worker killed by a signal has a negative exit code. Killed by a stop signal the parent
    forwarded (SIGINT, SIGTERM), it stopped as asked: a worker still starting up (its
    interpreter not yet running our code) ends that way, and that is a clean stop. A worker
    killed by any other signal, or exiting non-zero, fails the command.
    """
    stops = {signal.SIGINT, signal.SIGTERM} & forwarded
    codes = [0 if code < 0 and -code in stops else abs(code) for code in exit_codes]
    return max(codes, default=0)
