"""tests/support/session_guard.py on real pytest sessions run in a subprocess.

Each inner session gets the guard's hooks the way tests/conftest.py does and a test that leaves
something behind. It runs with ``-s``, so a process a test starts inherits the session's own
stdout (as one started outside pytest's capture does), and ``subprocess.run`` reads that output
to its end, as CI does: a process left holding it, or an interpreter that never exits, fails the
run's timeout here instead of hanging (each test of a leftover or a hang below does, without
the guard; the others show what the guard must leave alone).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.processes import alive
from tests.support.session_guard import EXIT_GRACE_ENV, SESSION_MARK, leftover_processes

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Far above what an inner session takes (a few seconds); only a hang reaches it.
HANG_GUARD_S = 120

_CONFTEST = """
from tests.support.session_guard import pytest_configure, pytest_sessionfinish, pytest_unconfigure
"""


def _write_project(folder: Path, test_source: str) -> None:
    """A test folder with the guard's hooks, as tests/conftest.py has them, and one test file."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "conftest.py").write_text(_CONFTEST)
    (folder / "test_inner.py").write_text(test_source)


def _run_session(
    tmp_path: Path, test_source: str, before: str = ""
) -> subprocess.CompletedProcess[str]:
    """The inner session, through ``sh -c '<before> exec python -m pytest ...'``."""
    _write_project(tmp_path, test_source)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), EXIT_GRACE_ENV: "2"}
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", str(tmp_path)]
    return subprocess.run(
        ["sh", "-c", f"{before} exec {shlex.join(pytest)}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
        check=False,
    )




def test_a_process_a_test_left_running_is_reported_and_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "orphan.pid"
    result = _run_session(tmp_path, f"""
import subprocess, sys
def test_leaves_a_process() -> None:
    # Inherits the session's stdout, as a forgotten server would: CI's read never ends.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open({str(pid_file)!r}, "w").write(str(child.pid))
""")
    assert result.returncode == 0, result.stdout + result.stderr
    pid = int(pid_file.read_text())
    assert f"1 process(es) a test left running, now killed:\n  pid {pid}: " in result.stdout
    assert "time.sleep(600)" in result.stdout
    assert not alive(pid)


def test_a_forked_child_a_test_left_running_is_found_without_the_mark(tmp_path: Path) -> None:
    """A child made by ``fork`` alone (``multiprocessing``'s default here) shows the
    environment pytest started with, without the mark: it is found as a descendant."""
    pid_file = tmp_path / "forked.pid"
    result = _run_session(tmp_path, f"""
import os, time
def test_forks() -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    open({str(pid_file)!r}, "w").write(str(pid))
""")
    assert result.returncode == 0, result.stdout + result.stderr
    pid = int(pid_file.read_text())
    assert f"  pid {pid}: " in result.stdout
    assert not alive(pid)


def test_a_child_pytest_had_before_the_session_is_left_alone(tmp_path: Path) -> None:
    """A CI script that pipes its output through ``tee`` and then ``exec``s pytest gives pytest
    a child older than the session: killed, the log lost its summary and the run its status."""
    pid_file = tmp_path / "older.pid"
    result = _run_session(
        tmp_path,
        "def test_nothing() -> None:\n    pass\n",
        before=f"sleep 600 >/dev/null 2>&1 & echo $! > {shlex.quote(str(pid_file))};",
    )
    pid = int(pid_file.read_text())
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "left running" not in result.stdout
        assert alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_session_fixtures_process_is_no_leftover_when_the_run_is_interrupted(
    tmp_path: Path,
) -> None:
    """Interrupted, pytest tears the session's fixtures down in its own end-of-session hook:
    the guard looks after that, so what a fixture stops is not reported."""
    result = _run_session(tmp_path, """
import subprocess, sys
import pytest
@pytest.fixture(scope="session")
def server():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()
def test_interrupted(server) -> None:
    raise KeyboardInterrupt
""")
    assert result.returncode == 2, result.stdout + result.stderr  # interrupted
    assert "left running" not in result.stdout


def test_a_stuck_non_daemon_thread_does_not_hold_the_exit(tmp_path: Path) -> None:
    result = _run_session(tmp_path, """
import threading
def wait_for_ever() -> None:
    threading.Event().wait()
def test_leaves_a_thread() -> None:
    threading.Thread(target=wait_for_ever, name="stuck").start()
""")
    assert result.returncode == 0, result.stdout + result.stderr  # pytest's own status
    assert "1 passed" in result.stdout
    assert "had not exited 2 s after pytest finished" in result.stderr
    assert "wait_for_ever" in result.stderr  # the stuck thread's stack, to fix it at its cause


def test_a_thread_pool_stuck_at_exit_does_not_hold_it(tmp_path: Path) -> None:
    """``ThreadPoolExecutor`` joins its workers before the main thread is marked stopped."""
    result = _run_session(tmp_path, """
import threading
from concurrent.futures import ThreadPoolExecutor
def test_leaves_a_pool_task() -> None:
    ThreadPoolExecutor(1).submit(threading.Event().wait)
""")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "had not exited 2 s after pytest finished" in result.stderr


def test_a_failed_session_keeps_its_status_when_the_guard_ends_it(tmp_path: Path) -> None:
    result = _run_session(tmp_path, """
import threading
def test_fails_and_leaves_a_thread() -> None:
    threading.Thread(target=threading.Event().wait).start()
    assert False
""")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "had not exited" in result.stderr


def test_a_nested_session_leaves_the_outer_sessions_processes_alone(tmp_path: Path) -> None:
    outer = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        assert outer.pid in {p.pid for p in leftover_processes(os.environ[SESSION_MARK])}
        result = _run_session(tmp_path, "def test_nothing() -> None:\n    pass\n")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "left running" not in result.stdout
        assert outer.poll() is None  # this session's process, not the inner one's
    finally:
        outer.kill()
        outer.wait()


def test_a_session_run_in_process_leaves_its_caller_alone(tmp_path: Path) -> None:
    """``pytest.main`` with the guard inside a longer program: the session leaves the program's
    own child alone, and the program goes on past the grace and exits with its own status."""
    (tmp_path / "inner").mkdir()
    _write_project(tmp_path / "inner", "def test_nothing() -> None:\n    pass\n")
    program = f"""
import subprocess, sys, threading, time
import pytest
own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
try:
    assert pytest.main(["-p", "no:cacheprovider", "-q", {str(tmp_path / "inner")!r}]) == 0
    assert own.poll() is None, "the session killed its caller's own child"
    time.sleep(4)  # twice the grace: a guard timing the caller would have ended it by now
    # ... or while its own worker finishes after the main thread:
    threading.Thread(target=time.sleep, args=(4,)).start()
    print("the caller finished its own work", flush=True)
finally:
    own.kill()
sys.exit(7)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), EXIT_GRACE_ENV: "2"}
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=HANG_GUARD_S, check=False,
    )
    assert result.returncode == 7, result.stdout + result.stderr
    assert "the caller finished its own work" in result.stdout
