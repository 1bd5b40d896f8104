"""Per-process call counters of the kernels: the proof that an engine really ran them.

"The plugin imported" says nothing about whether the model's layers call the kernel (vLLM may
keep its own implementation, for example when ``torch.compile`` disables custom ops). So every
call of a kernel op is counted here, in the process that runs it. ``counts()`` reads them in
process; with ``FLEETGATE_KERNEL_TRACE_DIR`` set, each process also rewrites
``<dir>/<pid>.json`` after every call, so a test or an operator can read them from outside the
engine. That file write costs tens of microseconds per call: a debugging and testing aid, off by
default. (Counts are Python-level calls: under CUDA graphs a replayed graph calls nothing.)
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from pathlib import Path

__all__ = ["TRACE_DIR_ENV", "counts", "record", "reset", "trace_path"]

TRACE_DIR_ENV = "FLEETGATE_KERNEL_TRACE_DIR"

_lock = threading.Lock()
#: op name -> {"calls": n, "rows": total rows normalised}
_counts: dict[str, dict[str, int]] = {}


def trace_path(directory: str | os.PathLike[str], pid: int | None = None) -> Path:
    """Where process ``pid`` (default: this one) writes its counters."""
    return Path(directory) / f"{os.getpid() if pid is None else pid}.json"


def record(op: str, rows: int) -> None:
    """Count one call of ``op`` over ``rows`` rows; write the trace file if one is configured."""
    with _lock:
        entry = _counts.setdefault(op, {"calls": 0, "rows": 0})
        entry["calls"] += 1
        entry["rows"] += rows
        snapshot = {name: dict(c) for name, c in _counts.items()}
    directory = os.environ.get(TRACE_DIR_ENV)
    if directory:
        _write(directory, snapshot)


def _write(directory: str, snapshot: dict[str, dict[str, int]]) -> None:
    from replica.kernels import __version__

    path = trace_path(directory)
    tmp = path.with_suffix(f".tmp{threading.get_ident()}")
    body = {"pid": os.getpid(), "process": multiprocessing.current_process().name,
            "version": __version__, "ops": snapshot}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(body, sort_keys=True))
    os.replace(tmp, path)  # readers never see a half-written file


def counts() -> dict[str, dict[str, int]]:
    """This process's counters: op -> {"calls", "rows"}."""
    with _lock:
        return {name: dict(c) for name, c in _counts.items()}


def reset() -> None:
    """Forget this process's counters (tests)."""
    with _lock:
        _counts.clear()
