"""``fleetgate simulate --jobs N`` stopped by a SIGTERM to its own process only (``kill PID``, a
supervisor): its workers go with it. The CLI review found them orphaned, each hung for ever
writing its result to a pipe nobody read."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from traces.format import TraceRecord, write_trace


def _processes_naming(marker: str) -> list[int]:
    """Pids whose command line mentions ``marker`` (workers inherit their parent's)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # gone meanwhile
    return found


def test_a_sigterm_to_simulate_stops_its_worker_processes(tmp_path: Path) -> None:
    trace = tmp_path / "sigterm-workers-trace.jsonl"
    # Long enough that the sweep is still running when the signal comes.
    write_trace(
        [TraceRecord(i * 5, 1024, 200, (i % 50, 1000 + i)) for i in range(6000)], trace
    )
    command = [
        sys.executable, "-m", "fleetgate.cli", "simulate", "--trace", str(trace),
        "--policies", "fleet-cost,round-robin,expected-ttft", "--rate-scale", "1,2",
        "--jobs", "2", "--no-progress",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(_processes_naming(trace.name)) < 3:  # the parent and both workers
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _processes_naming(trace.name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_naming(trace.name) == []
    finally:
        for pid in _processes_naming(trace.name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.kill()
