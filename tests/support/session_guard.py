"""A test session always ends: what it leaves running is reported and stopped.

CI waits for the test command to exit and for its output to close. A process that a test started
and left running (it holds the session's stdout) or a non-daemon thread stuck in a blocking call
keeps it from ending after pytest's summary: one CI run printed "2787 passed in 1007 s" and then
ran out its 5,400 s without a word. Two guards, each saying what it found so the cause can be
fixed where it is:

* at the session's end, every process still running that carries this session's mark (an
  environment variable set when pytest starts, which children inherit: orphans and processes in
  sessions of their own are found too) is listed in the terminal and killed;
* once pytest is done, the interpreter gets ``FLEETGATE_TEST_EXIT_GRACE_S`` (60 s) to exit; past
  that, every thread's stack goes to stderr and the process exits with pytest's own status.

Hooks, imported by tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Set in this process's environment at import; every process started from it inherits it.
SESSION_MARK = "FLEETGATE_TEST_SESSION"
EXIT_GRACE_ENV = "FLEETGATE_TEST_EXIT_GRACE_S"
DEFAULT_EXIT_GRACE_S = 60.0

_EXIT_STATUS = pytest.StashKey[int]()
_MARK = pytest.StashKey[str]()


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str


def mark_session() -> str:
    """Mark this process's children as this session's; a nested session (a test that runs
    pytest) marks its own, so it never stops what the outer session started."""
    mark = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[SESSION_MARK] = mark
    return mark


def leftover_processes(mark: str, proc: Path = Path("/proc")) -> list[Leftover]:
    """Processes other than this one whose environment carries ``mark``."""
    needle = f"{SESSION_MARK}={mark}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for a zombie
            command = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        if needle in environ.split(b"\0"):
            text = command.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(Leftover(int(entry.name), text[:200]))
    return found


def stop_leftovers(mark: str) -> list[Leftover]:
    """Kill what ``leftover_processes`` finds; returns what it killed."""
    leftovers = leftover_processes(mark)
    for leftover in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leftover.pid, signal.SIGKILL)
    return leftovers


def exit_grace_s() -> float:
    raw = os.environ.get(EXIT_GRACE_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_EXIT_GRACE_S
    except ValueError:
        return DEFAULT_EXIT_GRACE_S


def _exit_if_stuck(status: int, grace_s: float) -> None:
    time.sleep(grace_s)
    sys.stderr.write(
        f"\nfleetgate tests: the test process had not exited {grace_s:.0f} s after pytest "
        f"finished (a non-daemon thread or an exit handler is stuck); every thread's stack "
        f"follows, then it exits with pytest's status {status}.\n"
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(status)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_MARK] = mark_session()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)
    leftovers = stop_leftovers(session.config.stash[_MARK])
    if not leftovers:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else print
    write(f"fleetgate tests: {len(leftovers)} process(es) a test left running, now killed:")
    for leftover in leftovers:
        write(f"  pid {leftover.pid}: {leftover.command}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    status = config.stash.get(_EXIT_STATUS, 0)
    # A daemon thread: it never holds the exit up itself, and runs while the main thread waits
    # on non-daemon threads and exit handlers.
    threading.Thread(
        target=_exit_if_stuck, args=(status, exit_grace_s()), name="exit-guard", daemon=True
    ).start()
