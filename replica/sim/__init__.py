"""The simulated vLLM replica: an engine model (this package) driven by an HTTP server or the
fleet simulator. ``EngineModel`` is pure and deterministic; see ``docs/simulator.md``."""

from replica.sim.engine import (
    EngineConfig,
    EngineModel,
    EngineStats,
    KVEventRecord,
    SimRequest,
    StepResult,
    UnknownAdapterError,
)

__all__ = [
    "EngineConfig",
    "EngineModel",
    "EngineStats",
    "KVEventRecord",
    "SimRequest",
    "StepResult",
    "UnknownAdapterError",
]
