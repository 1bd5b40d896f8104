"""A test session always ends: what it leaves running is reported and stopped.

CI waits for the test command to exit and for its output to close. A process that a test started
and left running (it may hold the session's stdout) or a non-daemon thread stuck in a blocking
call keeps it from ending after pytest's summary: one CI run printed "2787 passed in 1007 s" and
then ran out its 5,400 s without a word. Two guards, each saying what it found so the cause can be
fixed where it is:

* at the session's end, every process still running that the session started is listed in the
  terminal and killed: its descendants (forked or not, renamed or not), and any process carrying
  this session's mark (an environment variable set when pytest starts, which programs it starts
  inherit), for those orphaned to init;
* once the interpreter is exiting (its main thread done), it gets ``FLEETGATE_TEST_EXIT_GRACE_S``
  (60 s); past that, every thread's stack goes to stderr and the process exits with pytest's own
  status. A session run in-process (``pytest.main``) leaves its caller alone.

Hooks, imported by tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
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


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str


def mark_session() -> str:
    """Mark the processes this session starts from now on as its own."""
    mark = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[SESSION_MARK] = mark
    return mark


def leftover_processes(
    mark: str, root: int | None = None, proc: Path = Path("/proc")
) -> list[Leftover]:
    """Processes other than ``root`` (this one) that descend from it or whose environment
    carries ``mark``; zombies (dead, holding nothing) left out."""
    root = os.getpid() if root is None else root
    needle = f"{SESSION_MARK}={mark}".encode()
    parents: dict[int, int] = {}
    marked: set[int] = set()
    commands: dict[int, str] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            # The command may hold spaces and parentheses: the fields after its last ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            parents[pid] = int(fields[1])
            command = (entry / "cmdline").read_bytes()
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                marked.add(pid)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or another user's
            continue
        commands[pid] = command.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    ours = marked | _descendants(root, parents)
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


def stop_leftovers(mark: str) -> list[Leftover]:
    """Kill what ``leftover_processes`` finds; returns what it killed."""
    leftovers = leftover_processes(mark)
    for leftover in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leftover.pid, signal.SIGKILL)
    return leftovers


def exit_grace_s() -> float:
    """``FLEETGATE_TEST_EXIT_GRACE_S`` if it is a positive, finite number of seconds."""
    try:
        grace = float(os.environ.get(EXIT_GRACE_ENV, ""))
    except ValueError:
        return DEFAULT_EXIT_GRACE_S
    return grace if 0 < grace < math.inf else DEFAULT_EXIT_GRACE_S


class _ExitGuard:
    """One per process: ends it ``grace_s`` after its main thread finished, if it is still
    there (stuck joining a non-daemon thread, or in an exit handler)."""

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
    config.stash[_OUTER_MARK] = os.environ.get(SESSION_MARK)
    config.stash[_MARK] = mark_session()


# After the runner's own, which tears the session's fixtures down when a run is interrupted
# (Ctrl-C, ``pytest.exit``): what they stop is not a leftover.
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _ExitGuard.arm(session)
    leftovers = stop_leftovers(session.config.stash[_MARK])
    if not leftovers:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else print
    write(f"fleetgate tests: {len(leftovers)} process(es) a test left running, now killed:")
    for leftover in leftovers:
        write(f"  pid {leftover.pid}: {leftover.command}")


def pytest_unconfigure(config: pytest.Config) -> None:
    _ExitGuard.arm(None)
    outer = config.stash.get(_OUTER_MARK, None)
    if outer is None:
        os.environ.pop(SESSION_MARK, None)
    else:  # a session run in-process inside another: the outer one's mark again
        os.environ[SESSION_MARK] = outer
