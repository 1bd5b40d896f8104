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
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from replica.launcher import EngineExited, EngineProcess, EngineSupervisor
from tests.support.processes import alive
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
    assert not alive(grandchild)


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
    assert not any(alive(pid) for pid in _children(tmp_path))


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


async def test_an_engine_refusing_its_arguments_on_its_first_start_is_not_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Exit 2 before ever answering /health, on the first start: vLLM's argparse refused its
    arguments, and every restart would too (the CLI review: a crash loop, never giving up)."""
    usage = (
        "print('api_server.py: error: unrecognized arguments: --vllm-python'); "
        "raise SystemExit(2)"
    )
    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [sys.executable, "-c", usage],
            url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "e.log",
        ),
        backoff_min_s=0.01, backoff_max_s=0.02,  # and no max_restarts: never give up
    )
    assert await asyncio.wait_for(supervisor.run(asyncio.Event()), 60) == 2
    assert supervisor.restarts == 0
    assert "unrecognized arguments: --vllm-python" in caplog.text
    assert "refused its arguments" in caplog.text


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


async def test_a_hung_engine_is_stopped_and_restarted(tmp_path: Path) -> None:
    """An engine that stops answering /health (here SIGSTOPped) for ``liveness_timeout_s`` is
    taken for hung and restarted: it was left hung for good, its requests waiting (review)."""
    port = free_port()
    supervisor = EngineSupervisor(
        lambda: _stand_in(tmp_path, port), backoff_min_s=0.1, backoff_max_s=0.2,
        health_timeout_s=30, liveness_timeout_s=1.0, liveness_interval_s=0.2, stop_grace_s=1.0,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(supervisor.run(stop))
    try:
        await asyncio.wait_for(supervisor.healthy.wait(), 30)
        first = supervisor.process
        assert first is not None and first.pid is not None
        os.kill(first.pid, signal.SIGSTOP)
        await asyncio.wait_for(_until(lambda: supervisor.restarts == 1), 60)
        await asyncio.wait_for(supervisor.healthy.wait(), 30)
        assert supervisor.hung_stops == 1
        assert first.poll() is not None  # the stopped one is gone, not left beside the new one
        assert supervisor.process is not None and supervisor.process.pid != first.pid
    finally:
        stop.set()
        assert await asyncio.wait_for(running, 60) == 0


async def test_a_port_already_answering_is_an_error_not_our_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Something left on the engine's port (an orphaned engine) answered the health probe and
    passed for the new engine, which failed to bind; now the supervisor says so and exits 1."""
    port = free_port()
    squatter = _stand_in(tmp_path, port).start()
    try:
        squatter.wait_healthy(timeout_s=30)
        supervisor = EngineSupervisor(lambda: _stand_in(tmp_path / "new", port))
        assert await asyncio.wait_for(supervisor.run(asyncio.Event()), 30) == 1
    finally:
        squatter.stop(grace_s=5)
    assert supervisor.process is not None and supervisor.process.pid is None  # never started
    assert any(f"ss -ltnp 'sport = :{port}'" in r.getMessage() for r in caplog.records)


def test_an_engine_started_to_die_with_its_parent_does(tmp_path: Path) -> None:
    """A supervisor killed with SIGKILL left its engine running, holding port and memory."""
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from pathlib import Path
from replica.launcher import EngineProcess
engine = EngineProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                       url="http://127.0.0.1:1", log_path=Path({str(tmp_path / "e.log")!r}),
                       die_with_parent=True).start()
open({str(pids)!r}, "w").write(str(engine.pid))
time.sleep(600)
"""])
    try:
        deadline = time.monotonic() + 30
        while not (pids.exists() and pids.read_text()):
            assert time.monotonic() < deadline, "the engine never started"
            time.sleep(0.05)
        engine_pid = int(pids.read_text())
        assert alive(engine_pid)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 30
        while alive(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its supervisor"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait(timeout=10)


_CRASHES_AFTER = """
import http.server, os, sys, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Timer(float(sys.argv[2]), lambda: os._exit(5)).start()
server.serve_forever()
"""


async def test_max_restarts_counts_crashes_in_a_row_only(tmp_path: Path) -> None:
    """An engine that served ``stable_after_s`` starts the count again: over weeks, rare
    crashes must not add up to the supervisor giving up."""
    port = free_port()
    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [sys.executable, "-c", _CRASHES_AFTER, str(port), "1.0"],
            url=f"http://127.0.0.1:{port}", log_path=tmp_path / "e.log",
        ),
        backoff_min_s=0.01, backoff_max_s=0.02, max_restarts=1, stable_after_s=0.2,
        liveness_timeout_s=None,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(supervisor.run(stop))
    await asyncio.wait_for(_until(lambda: supervisor.restarts >= 3 or running.done()), 60)
    assert not running.done()
    stop.set()
    assert await asyncio.wait_for(running, 60) == 0


async def test_an_engine_hung_in_start_up_counts_against_max_restarts(tmp_path: Path) -> None:
    """Running is counted from the first health answer: an engine stopped for not starting
    passed for a stable one (its start-up counted as running), and a supervisor with
    ``--max-restarts`` restarted it for ever (diff review)."""
    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "e.log",
        ),
        backoff_min_s=0.01, backoff_max_s=0.02, max_restarts=2, stable_after_s=0.2,
        health_timeout_s=0.5, stop_grace_s=1.0,
    )
    assert await asyncio.wait_for(supervisor.run(asyncio.Event()), 60) == 128 + signal.SIGTERM
    assert supervisor.restarts_in_row == 2


async def test_a_stop_during_start_up_does_not_wait_for_a_drain(tmp_path: Path) -> None:
    """An engine that never answered has nothing to drain: the stop waited out the whole
    drain (30 s) before (live re-check)."""
    drained: list[bool] = []

    async def before_stop(_: EngineProcess) -> None:
        drained.append(True)

    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "e.log",
        ),
        before_stop=before_stop, stop_grace_s=1.0,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(supervisor.run(stop))
    await asyncio.wait_for(_until(lambda: supervisor.process is not None
                                  and supervisor.process.pid is not None), 30)
    stop.set()
    assert await asyncio.wait_for(running, 60) == 0
    assert drained == []
    assert supervisor.process is not None and supervisor.process.poll() is not None


async def test_a_crash_is_logged_with_the_end_of_the_engines_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Why an engine failed (out of memory, a port in use) is in its log only: the
    supervisor's own output quotes the last lines."""
    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [sys.executable, "-c", "print('RuntimeError: CUDA out of memory (no-such-gpu)');"
             "raise SystemExit(1)"],
            url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "e.log",
        ),
        backoff_min_s=0.01, backoff_max_s=0.02, max_restarts=1,
    )
    assert await asyncio.wait_for(supervisor.run(asyncio.Event()), 60) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("restarting" in m and "no-such-gpu" in m for m in messages), messages
    assert any("no restarts left" in m and "no-such-gpu" in m for m in messages), messages


async def test_a_stop_runs_before_stop_while_the_engine_still_serves(tmp_path: Path) -> None:
    """``fleetgate replica run`` drains there: the engine must still be up and answering."""
    port = free_port()
    seen: list[bool] = []

    async def before_stop(engine: EngineProcess) -> None:
        seen.append(engine.poll() is None and await asyncio.to_thread(engine.is_healthy))

    supervisor = EngineSupervisor(
        lambda: _stand_in(tmp_path, port), health_timeout_s=30, before_stop=before_stop
    )
    stop = asyncio.Event()
    running = asyncio.create_task(supervisor.run(stop))
    await asyncio.wait_for(supervisor.healthy.wait(), 30)
    stop.set()
    assert await asyncio.wait_for(running, 60) == 0
    assert seen == [True]
