"""The ``vllm.stat_logger_plugins`` entry point: the class vLLM instantiates.

This is the only module of the plugin that imports vLLM, at import time, because vLLM requires
the entry point to be a ``StatLoggerBase`` subclass (it checks ``issubclass``). vLLM loads stat
logger plugins in the API server process only, creates one instance per engine (data-parallel
rank) and calls ``record`` from its asyncio output loop after every engine step; all the work
lives in ``state_logger.EngineStateLogger``, which never blocks nor raises there.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from replica.vllm_plugin.config import PluginConfig
from replica.vllm_plugin.state_logger import EngineStateLogger, static_fields_from_config

__all__ = ["FleetgateStatLogger"]


class FleetgateStatLogger(StatLoggerBase):
    """Pushes scheduler state to Redis at engine-step granularity (see docs/vllm-plugin.md)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self._vllm_config = vllm_config
        # A bad FLEETGATE_* value raises here, at engine start-up, naming the variable.
        self._state = EngineStateLogger(
            PluginConfig.from_env(),
            engine_index=engine_index,
            static_fields=static_fields_from_config(vllm_config),
        )

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """One engine step's stats; handed off without I/O."""
        self._state.record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        """KV-cache size is known now: publish it with the engine's idle state."""
        self._state.engine_initialized(static_fields_from_config(self._vllm_config))

    def log(self) -> None:
        """Nothing: vLLM's periodic log tick is far coarser than what this logger publishes."""
