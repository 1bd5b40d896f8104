"""Import operator-supplied kernel plugins in the current engine process and report on them.

A kernel plugin is an ordinary Python module whose import registers custom ops with vLLM (for
example ``CustomOp.register_oot`` replacing a layer's implementation) or with PyTorch
(``torch.library``). vLLM's general plugins run in every engine process — the API server, the
EngineCore and each worker — and registrations are per process, so the import must happen in
each of them; this module is what the general plugin calls there.

A module may list the ops it registers in ``FLEETGATE_OPS`` (``"namespace::name"`` strings):
they are then looked up in ``torch.ops`` after the import, so "loaded" means "the op exists in
this process", not merely "the import did not raise".
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from replica.vllm_plugin.log import logger

__all__ = [
    "KernelLoadReport",
    "KernelPluginError",
    "aggregate_reports",
    "current_report",
    "defer_report_log",
    "flush_report_log",
    "load_kernel_plugins",
    "log_report",
    "module_version",
    "pid_alive",
    "set_current_report",
    "torch_op_exists",
]

#: Version recorded when neither ``__version__`` nor a distribution version can be found.
UNKNOWN_VERSION = "unknown"


class KernelPluginError(RuntimeError):
    """A kernel plugin failed to load and strict mode is on: the engine must not start."""


@dataclass
class KernelLoadReport:
    """What loading the configured kernel plugins did in one process."""

    pid: int
    process: str
    #: module -> version, for modules that imported (and whose declared ops exist).
    loaded: dict[str, str] = field(default_factory=dict)
    #: module -> ``"ExcType: message"`` for modules that did not.
    failed: dict[str, str] = field(default_factory=dict)
    #: module -> ops it declared in ``FLEETGATE_OPS`` and that were found registered.
    ops: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the value of this pid's field in ``kernel_procs``)."""
        return {
            "pid": self.pid,
            "process": self.process,
            "loaded": dict(self.loaded),
            "failed": dict(self.failed),
            "ops": {k: list(v) for k, v in self.ops.items()},
        }

    def summary(self) -> str:
        """One human line: ``a==1.0, b==2.1; FAILED c (ImportError: …)``."""
        parts = [", ".join(f"{m}=={v}" for m, v in self.loaded.items()) or "none loaded"]
        if self.failed:
            parts.append("FAILED " + ", ".join(f"{m} ({e})" for m, e in self.failed.items()))
        return "; ".join(parts)


_current: KernelLoadReport | None = None
_log_deferred = False


def current_report() -> KernelLoadReport | None:
    """The report of this process's kernel-plugin loading, if the hook has run here."""
    return _current


def set_current_report(report: KernelLoadReport | None) -> None:
    """Remember ``report`` as this process's (the stat logger re-publishes it)."""
    global _current, _log_deferred
    _current = report
    _log_deferred = False


def log_report(report: KernelLoadReport) -> None:
    """The one log line per process that says which kernel plugins (and versions) it runs."""
    logger.info(
        "fleetgate: kernel plugins in %s (pid %d): %s",
        report.process, report.pid, report.summary(),
    )


def defer_report_log() -> None:
    """Logging is not set up yet in this process: ``flush_report_log`` logs the report later."""
    global _log_deferred
    _log_deferred = True


def flush_report_log() -> None:
    """Log this process's report if its line was deferred (once)."""
    global _log_deferred
    if _log_deferred and _current is not None:
        _log_deferred = False
        log_report(_current)


def module_version(module: ModuleType) -> str:
    """The module's ``__version__``, else its distribution's version, else ``"unknown"``."""
    version = getattr(module, "__version__", None)
    if isinstance(version, str) and version:
        return version
    from importlib.metadata import PackageNotFoundError, packages_distributions
    from importlib.metadata import version as dist

    top = module.__name__.split(".", 1)[0]
    for distribution in packages_distributions().get(top, []):
        try:
            return dist(distribution)
        except PackageNotFoundError:
            continue
    return UNKNOWN_VERSION


def torch_op_exists(namespace: str, name: str) -> bool:
    """True if ``torch.ops.<namespace>.<name>`` is registered in this process."""
    import torch

    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _missing_ops(declared: Iterable[str], op_exists: Callable[[str, str], bool]) -> list[str]:
    """The declared ``namespace::name`` ops that ``op_exists`` does not find."""
    missing = []
    for qualified in declared:
        namespace, sep, name = qualified.partition("::")
        if not sep or not namespace or not name:
            missing.append(f"{qualified} (not 'namespace::name')")
        elif not op_exists(namespace, name):
            missing.append(qualified)
    return missing


#: Frames of the import machinery (and of this loader) say nothing about the plugin: skipped.
_IMPORTLIB_DIR = f"{os.sep}importlib{os.sep}"


def _error_text(exc: BaseException) -> str:
    # The last frame says where it broke (inside the plugin, usually); the full traceback
    # goes to the log, Redis gets one readable line.
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and _IMPORTLIB_DIR not in f.filename
              and f.filename != __file__]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def load_kernel_plugins(
    modules: Iterable[str],
    importer: Callable[[str], ModuleType] = importlib.import_module,
    on_error: Callable[[str, BaseException], None] | None = None,
    op_exists: Callable[[str, str], bool] = torch_op_exists,
) -> KernelLoadReport:
    """Import each module in order; collect versions, verified ops and failures.

    Never raises for a failing plugin: the caller decides (strict mode) after the failure has
    been recorded, so the reason reaches Redis and the log even when the engine then aborts.
    ``on_error`` sees each exception (the hook logs the traceback there); ``op_exists`` checks
    declared ops (default: ``torch.ops``; tests pass their own, torch is not in every venv).
    """
    report = KernelLoadReport(pid=os.getpid(), process=multiprocessing.current_process().name)
    for name in modules:
        try:
            module = importer(name)
            declared = list(getattr(module, "FLEETGATE_OPS", ()) or ())
            if declared:
                missing = _missing_ops(declared, op_exists)
                if missing:
                    raise KernelPluginError(
                        f"declares ops it did not register: {', '.join(missing)}"
                    )
                report.ops[name] = declared
            report.loaded[name] = module_version(module)
        except Exception as exc:  # an import can raise anything; each one is reported
            report.failed[name] = _error_text(exc)
            if on_error is not None:
                on_error(name, exc)
    return report


def aggregate_reports(
    reports: Iterable[Mapping[str, Any]],
) -> tuple[dict[str, str], dict[str, str]]:
    """Fold per-process reports into the replica's view: (module -> version, module -> error).

    A module counts as loaded only if it loaded in every reporting process (a kernel registered
    in the API server but not in the worker that runs the model is not serving); a failure in
    any process is listed, prefixed with that process's name.
    """
    reports = list(reports)
    loaded: dict[str, str] = {}
    errors: dict[str, str] = {}
    for report in reports:
        for module, error in report.get("failed", {}).items():
            errors.setdefault(module, f"{report.get('process', '?')}: {error}")
    for report in reports:
        for module, version in report.get("loaded", {}).items():
            if module not in errors and all(module in r.get("loaded", {}) for r in reports):
                loaded.setdefault(module, version)
    return loaded, errors


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists in this PID namespace (engine processes are all local children)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
