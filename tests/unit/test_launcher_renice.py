"""``renice_processes``: vLLM's busy-polling processes run at a lower priority in benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replica.launcher import EngineProcess, _group_members, renice_processes

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")


def _members(pgid: int, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(_group_members(pgid)) < count:
        assert time.monotonic() < deadline, f"group {pgid} never had {count} members"
        time.sleep(0.02)


def test_only_the_named_processes_of_the_group_are_reniced() -> None:
    # A group like vLLM's: a leader (here `cat`) and a child with another name (`sleep`).
    group = subprocess.Popen(
        ["sh", "-c", "sleep 60 & exec cat"], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        _members(group.pid, 2)
        before = os.getpriority(os.PRIO_PROCESS, group.pid)
        changed = renice_processes(group.pid, "sleep", before + 7)
        assert len(changed) == 1 and changed[0] != group.pid
        assert os.getpriority(os.PRIO_PROCESS, changed[0]) == before + 7
        assert os.getpriority(os.PRIO_PROCESS, group.pid) == before  # `cat` keeps its priority
        assert renice_processes(group.pid, "no-such-name", before + 7) == []
    finally:
        os.killpg(group.pid, 9)
        group.wait()


def test_every_thread_of_a_reniced_process_follows() -> None:
    code = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        comm = Path(f"/proc/{child.pid}/comm").read_text().strip()
        base = os.getpriority(os.PRIO_PROCESS, child.pid)
        assert renice_processes(child.pid, comm[:4], base + 5) == [child.pid]
        threads = os.listdir(f"/proc/{child.pid}/task")
        assert len(threads) >= 2
        assert {os.getpriority(os.PRIO_PROCESS, int(t)) for t in threads} == {base + 5}
    finally:
        os.killpg(child.pid, 9)
        child.wait()


def test_an_engine_not_started_lowers_nothing() -> None:
    assert EngineProcess(["true"], "http://127.0.0.1:1").lower_busy_pollers() == []
