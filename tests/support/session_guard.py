"""A test session always ends: what it leaves running is reported and stopped.

CI waits for the test command to exit and for its output to close. A process that a test started
and left running (it may hold the session's stdout) or a non-daemon thread stuck in a blocking
call keeps it from ending after pytest's summary: one CI run printed "2787 passed in 1007 s" and
then ran out its 5,400 s without a word. Two guards, each saying what it found so the cause can be
fixed where it is:

* at the session's end, every process still running that the session started is listed in the
  terminal and killed: pytest's descendants started since the session began (forked or not,
  renamed or not; not those already there, such as a ``tee`` the CI script gave it), and any
  process carrying this session's mark (an environment variable set when pytest starts, which
  programs it starts inherit), for those orphaned to init;
* when pytest is the program (not ``pytest.main`` inside another), once the interpreter is
  exiting it gets ``FLEETGATE_TEST_EXIT_GRACE_S`` (60 s); past that, every thread's stack goes
  to stderr and the process exits with pytest's own status.

Hooks, imported by tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Set in this process's environment when pytest starts; programs started from it inherit it
#: (a child made by ``fork`` alone does not show it: it is found as a descendant).
SESSION_MARK = "FLEETGATE_TEST_SESSION"
EXIT_GRACE_ENV = "FLEETGATE_TEST_EXIT_GRACE_S"
DEFAULT_EXIT_GRACE_S = 60.0
_POLL_S = 0.5

_MARK = pytest.StashKey[str]()
_OUTER_MARK = pytest.StashKey["str | None"]()
_STARTED_TICKS = pytest.StashKey[int]()


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str


def mark_session() -> str:
    """Mark the processes this session starts from now on as its own."""
    mark = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[SESSION_MARK] = mark
    return mark


def clock_ticks() -> int:
    """Now, in the unit of a process's start time in ``/proc/PID/stat``: ticks since boot."""
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    return int(uptime_s * os.sysconf("SC_CLK_TCK"))


def leftover_processes(
    mark: str, since_ticks: int = 0, root: int | None = None, proc: Path = Path("/proc")
) -> list[Leftover]:
    """Processes other than ``root`` (this one) that descend from it and started at or after
    ``since_ticks`` (``clock_ticks``), or whose environment carries ``mark``; zombies (dead,
    holding nothing) left out."""
    root = os.getpid() if root is None else root
    needle = f"{SESSION_MARK}={mark}".encode()
    parents: dict[int, int] = {}
    started: dict[int, int] = {}
    marked: set[int] = set()
    commands: dict[int, str] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            # The name may hold spaces, parentheses or any byte: the fields after its last ')'
            # (the third field on, so the parent is the second here, the start time the 20th).
            fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":
                continue
            parents[pid], started[pid] = int(fields[1]), int(fields[19])
            command = (entry / "cmdline").read_bytes()
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                marked.add(pid)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or another user's
            continue
        commands[pid] = command.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    # Descendants only from this session on: not the processes of whoever started pytest (a
    # ``tee`` it exec'd into) or called it in-process (its own children, an outer session's).
    ours = marked | {pid for pid in _descendants(root, parents) if started[pid] >= since_ticks}
    ours.discard(root)
    return [Leftover(pid, commands.get(pid, "")) for pid in sorted(ours)]


def _descendants(root: int, parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def stop_leftovers(mark: str, since_ticks: int) -> list[Leftover]:
    """Kill what ``leftover_processes`` finds; returns what it found."""
    leftovers = leftover_processes(mark, since_ticks)
    for leftover in leftovers:
        # Gone meanwhile, or another user's (a test's ``sudo``): listed all the same.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(leftover.pid, signal.SIGKILL)
    return leftovers


def pytest_is_the_program() -> bool:
    """Whether this process is ``pytest`` / ``python -m pytest`` rather than a program that
    calls ``pytest.main``, whose exit is its own business."""
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return program.name in {"pytest", "py.test"} or program.parent.name == "pytest"


def exit_grace_s() -> float:
    """``FLEETGATE_TEST_EXIT_GRACE_S`` if it is a positive, finite number of seconds."""
    try:
        grace = float(os.environ.get(EXIT_GRACE_ENV, ""))
    except ValueError:
        return DEFAULT_EXIT_GRACE_S
    return grace if 0 < grace < math.inf else DEFAULT_EXIT_GRACE_S


class _ExitGuard:
    """One per process: ends it ``exit_grace_s()`` after the interpreter began to exit, if it is
    still there (stuck joining a thread or a pool's workers, or in an exit handler)."""

    started = False
    session: pytest.Session | None = None

    @classmethod
    def arm(cls, session: pytest.Session | None) -> None:
        if session is not None:
            cls.session = session  # the latest to finish: the outermost, when nested
        if not cls.started:
            cls.started = True
            # A daemon thread: it never holds the exit up itself, and runs while the main
            # thread waits on non-daemon threads and exit handlers.
            threading.Thread(target=cls._watch, name="exit-guard", daemon=True).start()

    @classmethod
    def _watch(cls) -> None:
        grace_s = exit_grace_s()
        main = threading.main_thread()
        # Interpreter exit says it is shutting down, runs the thread pools' exit hooks (their
        # joins), marks the main thread stopped, joins the other threads and runs the exit
        # handlers; until then pytest (or whoever called it) is still at work.
        while main.is_alive() and not getattr(threading, "_SHUTTING_DOWN", False):
            time.sleep(_POLL_S)
        time.sleep(grace_s)
        status = cls.session.exitstatus if cls.session is not None else 1
        try:
            # Straight to the descriptor: stderr's buffer may be locked by the stuck thread.
            os.write(
                2,
                f"\nfleetgate tests: the test process had not exited {grace_s:.0f} s after pytest "
                f"finished (a non-daemon thread or an exit handler is stuck); every thread's stack "
                f"follows, then it exits with pytest's status {int(status)}.\n".encode(),
            )
            faulthandler.dump_traceback(file=2, all_threads=True)
        finally:
            os._exit(int(status))


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STARTED_TICKS] = clock_ticks()
    config.stash[_OUTER_MARK] = os.environ.get(SESSION_MARK)
    config.stash[_MARK] = mark_session()


# After the runner's own, which tears the session's fixtures down when a run is interrupted
# (Ctrl-C, ``pytest.exit``): what they stop is not a leftover.
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if pytest_is_the_program():
        _ExitGuard.arm(session)
    config = session.config
    leftovers = stop_leftovers(config.stash[_MARK], config.stash[_STARTED_TICKS])
    if not leftovers:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else print
    write(f"fleetgate tests: {len(leftovers)} process(es) a test left running, now killed:")
    for leftover in leftovers:
        write(f"  pid {leftover.pid}: {leftover.command}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if pytest_is_the_program():
        _ExitGuard.arm(None)
    outer = config.stash.get(_OUTER_MARK, None)
    if outer is None:
        os.environ.pop(SESSION_MARK, None)
    else:  # a session run in-process inside another: the outer one's mark again
        os.environ[SESSION_MARK] = outer
