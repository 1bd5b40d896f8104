"""``EngineSupervisor`` and ``EngineProcess`` on a stand-in process (not vLLM).

These test process supervision only: start, health wait, restart with back-off after a crash,
and stopping the whole process group. The child is a tiny HTTP server that also spawns a
grandchild, like vLLM's EngineCore, to prove the group dies with it. Real-engine supervision is
exercised by docs/e2e.md's `fleetgate replica run` run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from replica.launcher import EngineExited, EngineProcess, EngineSupervisor
from tests.support.redis_server import free_port

_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "a").write(f"{child.pid}\\n")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _stand_in(tmp_path: Path, port: int) -> EngineProcess:
    return EngineProcess(
        [sys.executable, "-c", _SERVER, str(port), str(tmp_path / "children")],
        url=f"http://127.0.0.1:{port}",
        log_path=tmp_path / "engine.log",
    )


def _children(tmp_path: Path) -> list[int]:
    path = tmp_path / "children"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    engine = _stand_in(tmp_path, free_port()).start()
    try:
        assert engine.wait_healthy(timeout_s=30) >= 0
    finally:
        engine.stop(grace_s=5)
    assert engine.poll() is not None
    # ``stop`` returns once the group is gone, not merely signalled: a restart must not race the
    # old EngineCore for its port and memory.
    (grandchild,) = _children(tmp_path)
    assert not _alive(grandchild)


def test_wait_healthy_reports_an_early_exit_with_the_log(tmp_path: Path) -> None:
    engine = EngineProcess(
        [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
        url=f"http://127.0.0.1:{free_port()}",
        log_path=tmp_path / "engine.log",
    ).start()
    with pytest.raises(EngineExited, match=r"code 3(?s:.)*boom: bad flag"):
        engine.wait_healthy(timeout_s=30)


async def test_supervisor_restarts_a_crashed_engine_and_stops_on_request(tmp_path: Path) -> None:
    port = free_port()
    restarts: list[float] = []

    async def on_restart() -> None:
        restarts.append(time.monotonic())

    supervisor = EngineSupervisor(
        lambda: _stand_in(tmp_path, port), on_restart, backoff_min_s=0.1, backoff_max_s=0.2,
        health_timeout_s=30,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(supervisor.run(stop))
    await asyncio.wait_for(supervisor.healthy.wait(), 30)
    first = supervisor.process
    assert first is not None and first.pid is not None
    os.kill(first.pid, signal.SIGKILL)  # a crash
    await asyncio.wait_for(_until(lambda: supervisor.restarts == 1), 30)
    await asyncio.wait_for(supervisor.healthy.wait(), 30)
    second = supervisor.process
    assert second is not None and second.pid != first.pid
    assert len(restarts) == 1
    stop.set()
    assert await asyncio.wait_for(running, 60) == 0
    assert second.poll() is not None
    assert not any(_alive(pid) for pid in _children(tmp_path))


async def test_supervisor_gives_up_after_max_restarts(tmp_path: Path) -> None:
    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [sys.executable, "-c", "raise SystemExit(5)"],
            url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "e.log",
        ),
        backoff_min_s=0.01, backoff_max_s=0.02, max_restarts=2,
    )
    assert await asyncio.wait_for(supervisor.run(asyncio.Event()), 60) == 5
    assert supervisor.restarts == 2


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


async def test_an_engine_killed_by_a_signal_exits_with_128_plus_the_signal(
    tmp_path: Path,
) -> None:
    """Popen reports a signal as -N; a process's exit status cannot be negative (-15 read as
    241), so the supervisor returns the shell's 128 + N."""
    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
            url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "e.log",
        ),
        backoff_min_s=0.01, backoff_max_s=0.02, max_restarts=0,
    )
    assert await asyncio.wait_for(supervisor.run(asyncio.Event()), 60) == 128 + 15
