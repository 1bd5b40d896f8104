"""Optional dependencies of the CLI: charts (matplotlib) and progress bars (tqdm).

The serving install (``pip install fleetgate``, the Docker image) carries neither; the planning
and benchmark tools name the extra that brings them (pyproject.toml ``[plan]`` and ``[bench]``):

- a chart the user asked for (``--plot``) cannot be skipped: the command stops before any work
  with the ``pip install`` line to run (``missing_extra``);
- a progress bar is a convenience: without tqdm the command runs without one and says why once
  (``progress_available``).
"""

from __future__ import annotations

import importlib.util
import sys

#: Extras as pyproject.toml names them.
PLAN = "plan"
BENCH = "bench"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    return importlib.util.find_spec(module) is not None


def install_hint(extra: str) -> str:
    """The command that installs ``extra``."""
    return f"pip install 'fleetgate[{extra}]'"


def missing_extra(module: str, extra: str, needed_for: str) -> str | None:
    """None when ``module`` is installed; else the error to print: what is missing, what to run."""
    if installed(module):
        return None
    return f"{needed_for} needs {module}, which is not installed: {install_hint(extra)}"


def progress_available(extra: str, command: str) -> bool:
    """True when tqdm is installed; otherwise say once on stderr that the bar is off, and why."""
    if installed("tqdm"):
        return True
    print(
        f"{command}: no progress bar (tqdm is not installed: {install_hint(extra)})",
        file=sys.stderr,
    )
    return False
