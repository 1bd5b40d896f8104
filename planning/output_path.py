"""Whether a file can be written at a path, checked before any work: a missing folder or a
read-only one found after minutes of measuring throws the measurement away. No plotting
dependency here, so serving commands may call it (``plot_path`` adds the image formats)."""

from __future__ import annotations

import os
from pathlib import Path


def output_path_problem(path: str | Path) -> str | None:
    """Why a file cannot be written at ``path`` (without the path), or None when it can."""
    path = Path(path)
    if path.is_dir():
        return "it is a directory"
    folder = path.parent
    if not folder.is_dir():
        return f"no such folder {folder}"
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "not writable"
    return None
