"""Whether a process is still there, for tests that check what was stopped."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (or stopped), not gone and not a zombie: a zombie still answers ``kill(pid, 0)``
    but holds nothing, so it counts as ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"
