"""Check a ``--plot FILE`` before any work is printed: a known image format, a writable folder.

matplotlib picks the format from the suffix and raises ``ValueError`` for one it cannot write;
a missing or read-only folder raises ``OSError``. Both ``plan capacity`` and ``plan levers``
check first, so a bad path is one line and exit 2, never a complete-looking table followed by an
error status.
"""

from __future__ import annotations

from pathlib import Path

from planning.output_path import output_path_problem


def supported_suffixes() -> frozenset[str]:
    """The file suffixes matplotlib can write (``png``, ``svg``, ``pdf``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return frozenset(FigureCanvasBase.get_supported_filetypes())


def plot_path_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot take a plot (without the path), or None when it can."""
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    formats = supported_suffixes()
    if not suffix:
        return f"no file suffix; use one of .{', .'.join(sorted(formats))}"
    if suffix not in formats:
        return f"format '{suffix}' is not supported; use one of .{', .'.join(sorted(formats))}"
    return output_path_problem(path)
