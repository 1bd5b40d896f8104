"""The ``vllm.general_plugins`` entry point: the kernel-plugin hook.

vLLM calls ``register()`` once in every engine process (API server, EngineCore, workers) before
models are built, and does not catch what it raises: raising here aborts the engine's start-up,
which is how strict mode (the default) refuses to serve without the kernels it was told to use.
"""

from __future__ import annotations

from replica.vllm_plugin.config import PluginConfig
from replica.vllm_plugin.kernels import (
    KernelLoadReport,
    KernelPluginError,
    defer_report_log,
    load_kernel_plugins,
    log_report,
    set_current_report,
)
from replica.vllm_plugin.keys import PluginKeys
from replica.vllm_plugin.log import logger

__all__ = ["STARTUP_TTL_S", "publish_kernel_report", "register"]

#: TTL of the kernel-plugin records each process writes at start-up. Long, because loading
#: weights and warming up can take minutes before the API server's stat logger starts refreshing
#: them (with the normal TTL); and if the engine never comes up (a strict-mode abort), nothing
#: refreshes them, yet the operator and the agent must still be able to read why.
STARTUP_TTL_S = 3600.0


def publish_kernel_report(config: PluginConfig, report: KernelLoadReport) -> bool:
    """Write ``report`` under the replica's kernel keys; False (logged) if Redis is unreachable.

    Synchronous with the configured short timeout: this runs once at process start-up.
    """
    if config.redis_url is None:
        return False
    from replica.vllm_plugin.redis_store import RedisStateStore, connect

    store = RedisStateStore(
        connect(config.redis_url, config.redis_timeout_s),
        PluginKeys(config.key_prefix, config.replica_id),
        config.ttl_s,
    )
    try:
        store.write_kernel_report(report.to_dict(), max(config.ttl_s, STARTUP_TTL_S))
    except Exception as exc:  # Redis down must not stop an engine whose kernels loaded
        logger.warning(
            "fleetgate: could not record kernel plugins of %s in Redis (%s: %s); only the API "
            "server's stat logger re-publishes its own report later",
            report.process, type(exc).__name__, exc,
        )
        return False
    finally:
        store.close()
    return True


def register() -> None:
    """Import ``FLEETGATE_KERNEL_PLUGINS`` here, record the outcome, abort if strict and failed."""
    config = PluginConfig.from_env()
    if not config.kernel_plugins:
        return

    def log_failure(name: str, exc: BaseException) -> None:
        logger.error("fleetgate: kernel plugin %s failed to load", name, exc_info=exc)

    report = load_kernel_plugins(config.kernel_plugins, on_error=log_failure)
    set_current_report(report)
    if logger.hasHandlers():
        log_report(report)
    else:
        # In the API server this runs while vLLM is still parsing arguments, before it has set
        # up logging: an INFO line now would vanish. The stat logger logs it once it exists.
        defer_report_log()
    publish_kernel_report(config, report)
    if report.failed and config.kernel_plugins_strict:
        raise KernelPluginError(
            f"kernel plugin(s) failed to load in {report.process} (pid {report.pid}): "
            + "; ".join(f"{m}: {e}" for m, e in report.failed.items())
            + ". The engine will not start without them; set FLEETGATE_KERNEL_PLUGINS_STRICT=0 "
            "to serve without the failed plugins instead."
        )
