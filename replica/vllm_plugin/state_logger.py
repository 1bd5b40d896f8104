"""The stat logger's logic, free of vLLM imports so it can be unit-tested anywhere.

``vllm_logger.FleetgateStatLogger`` (the class vLLM instantiates) forwards to ``EngineStateLogger``:
``record()`` folds the step into a snapshot and offers it to the ``StatePublisher`` thread, which
writes it to Redis. Nothing here raises into the engine loop.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from replica.vllm_plugin.config import PluginConfig
from replica.vllm_plugin.kernels import current_report, flush_report_log
from replica.vllm_plugin.keys import PluginKeys
from replica.vllm_plugin.log import logger
from replica.vllm_plugin.publisher import StatePublisher, WriteFn
from replica.vllm_plugin.snapshot import EngineSnapshot, SnapshotBuilder

__all__ = ["EngineStateLogger", "static_fields_from_config"]

_disabled_logged = threading.Event()


def static_fields_from_config(vllm_config: Any) -> dict[str, str]:
    """Engine facts that never change per step: block size, KV blocks, LoRA slots, model names.

    Duck-typed over ``VllmConfig``; a missing attribute is left out rather than guessed.
    ``num_gpu_blocks`` is only known once the engine has profiled memory, so this is called again
    from ``log_engine_initialized``.
    """
    fields: dict[str, str] = {}
    cache = getattr(vllm_config, "cache_config", None)
    for source, name in ((cache, "block_size"), (cache, "num_gpu_blocks")):
        value = getattr(source, name, None)
        if isinstance(value, int):
            fields[name] = str(value)
    lora = getattr(vllm_config, "lora_config", None)
    max_loras = getattr(lora, "max_loras", None)
    if isinstance(max_loras, int):
        fields["max_loras"] = str(max_loras)
    model = getattr(vllm_config, "model_config", None)
    served = getattr(model, "served_model_name", None)
    if isinstance(served, str):
        fields["served_model_name"] = served
    elif isinstance(served, list | tuple) and served:
        fields["served_model_name"] = ",".join(str(s) for s in served)
    return fields


class EngineStateLogger:
    """Publishes one engine's scheduler state; a no-op when the config has no Redis URL."""

    def __init__(
        self,
        config: PluginConfig,
        engine_index: int = 0,
        write: WriteFn | None = None,
        static_fields: Mapping[str, str] | None = None,
    ) -> None:
        """``write`` overrides the Redis writer (tests); by default one is built from ``config``."""
        self.config = config
        self.engine_index = engine_index
        self.keys = PluginKeys(config.key_prefix, config.replica_id)
        self._static: dict[str, str] = dict(static_fields or {})
        self._builder = SnapshotBuilder(engine_index, os.getpid())
        #: ``record`` calls that raised inside the plugin (swallowed; see ``record``).
        self.errors = 0
        self.publisher: StatePublisher | None = None
        self._store: Any = None
        self._last_reconcile = float("-inf")
        # vLLM has configured logging by the time it builds stat loggers: the kernel-plugin
        # line the general plugin could not log in this (API server) process goes out now.
        flush_report_log()
        if write is None and config.redis_url is None:
            if not _disabled_logged.is_set():
                _disabled_logged.set()
                logger.info("fleetgate: FLEETGATE_REDIS_URL is not set; engine state is not "
                            "published (the plugin does nothing)")
            return
        if write is None:
            from replica.vllm_plugin.redis_store import RedisStateStore, connect

            assert config.redis_url is not None
            self._store = RedisStateStore(
                connect(config.redis_url, config.redis_timeout_s), self.keys, config.ttl_s
            )
            write = self._write_redis
        self.publisher = StatePublisher(
            write,
            min_interval_s=config.min_interval_s,
            heartbeat_s=config.heartbeat_s,
            name=f"fleetgate-state-{engine_index}",
        ).start()
        logger.info(
            "fleetgate: publishing engine state to %s every >= %.0f ms (TTL %.0f s)",
            self.keys.engine(engine_index), config.min_interval_s * 1000, config.ttl_s,
        )

    @property
    def enabled(self) -> bool:
        """True when state is being published."""
        return self.publisher is not None

    def _write_redis(self, fields: Mapping[str, str] | None) -> None:
        report = current_report()
        now = time.monotonic()
        # Rebuilding the kernel keys costs a read; once per heartbeat period is plenty (the
        # first write after start-up always does it, dropping an earlier incarnation's records).
        reconcile = now - self._last_reconcile >= self.config.heartbeat_s
        self._store.write_engine(
            fields,
            self.engine_index,
            kernel_report=report.to_dict() if report is not None else None,
            reconcile=reconcile,
        )
        if reconcile:
            self._last_reconcile = now

    def engine_initialized(self, static_fields: Mapping[str, str]) -> None:
        """The engine is up: merge its facts into every later snapshot and publish the idle state.

        Publishing here (not only on the first step) lets readers see the replica's engine
        state before any request arrives. Never raises.
        """
        def fold() -> EngineSnapshot:
            self._static.update(static_fields)
            return self._builder.current()

        self._guarded(fold)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Fold one engine step in and hand the snapshot to the publisher. Never raises."""
        self._guarded(lambda: self._builder.update(scheduler_stats, iteration_stats))

    def _guarded(self, fold: Callable[[], EngineSnapshot]) -> None:
        if self.publisher is None:
            return
        try:
            self.publisher.offer({**fold().to_fields(), **self._static})
        except Exception:  # a plugin bug must cost a counter, not the engine loop
            self.errors += 1
            if self.errors == 1:
                logger.exception("fleetgate: engine state logger failed (counted from now on)")

    def close(self) -> None:
        """Stop the publisher thread and release the Redis connection."""
        if self.publisher is not None:
            self.publisher.stop()
        if self._store is not None:
            self._store.close()
