"""Turn vLLM's per-step stats objects into a flat snapshot of scheduler state.

Duck-typed on purpose: vLLM documents ``SchedulerStats``/``IterationStats`` as unstable, and this
module must import (and be unit-tested) without vLLM installed. Every attribute is read with a
default, so a renamed field degrades to a zero instead of an exception inside the engine loop.

Field names follow ``routing.state.ReplicaState`` (``kv_usage``, ``running``, ``waiting``,
``preemptions_total``, ``metrics_read_at``) so whoever merges the hash into a ``ReplicaState``
maps names one to one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineSnapshot", "SnapshotBuilder"]


def _int(obj: Any, name: str) -> int:
    value = getattr(obj, name, 0)
    return int(value) if isinstance(value, int | float) else 0


def _adapter_counts(obj: Any, name: str) -> dict[str, int]:
    raw = getattr(obj, name, None)
    if not isinstance(raw, Mapping):
        return {}
    # Adapters with zero requests are noise vLLM sometimes leaves in; drop them.
    return {str(k): int(v) for k, v in raw.items() if isinstance(v, int | float) and v > 0}


@dataclass(frozen=True)
class EngineSnapshot:
    """Scheduler state after one engine step, plus counters accumulated since the logger began."""

    engine_index: int
    #: Fraction of KV blocks in use, 0..1 (as ``vllm:kv_cache_usage_perc``).
    kv_usage: float
    running: int
    #: Waiting requests including deferred ones (as ``vllm:num_requests_waiting``).
    waiting: int
    #: The part of ``waiting`` deferred by transient constraints (e.g. no free LoRA slot).
    waiting_deferred: int
    running_adapters: dict[str, int] = field(default_factory=dict)
    waiting_adapters: dict[str, int] = field(default_factory=dict)
    #: Counters since this logger started (a restart resets them, like vLLM's own counters).
    preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    #: Engine steps seen by this logger (including steps without scheduler stats).
    steps: int = 0
    #: Wall-clock time (``time.time()``) of the step, comparable across hosts.
    metrics_read_at: float = 0.0
    #: The writing process, so a reader can tell a restarted engine from a continuing one.
    pid: int = 0
    started_at: float = 0.0

    def to_fields(self) -> dict[str, str]:
        """Redis hash fields: numbers as decimal strings, adapter counts as JSON objects."""
        return {
            "engine_index": str(self.engine_index),
            "kv_usage": repr(float(self.kv_usage)),
            "running": str(self.running),
            "waiting": str(self.waiting),
            "waiting_deferred": str(self.waiting_deferred),
            "running_adapters": json.dumps(self.running_adapters, sort_keys=True),
            "waiting_adapters": json.dumps(self.waiting_adapters, sort_keys=True),
            "preemptions_total": str(self.preemptions_total),
            "prefix_cache_queries_total": str(self.prefix_cache_queries_total),
            "prefix_cache_hits_total": str(self.prefix_cache_hits_total),
            "steps": str(self.steps),
            "metrics_read_at": repr(float(self.metrics_read_at)),
            "pid": str(self.pid),
            "started_at": repr(float(self.started_at)),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str | bytes, str | bytes]) -> EngineSnapshot:
        """Parse what ``to_fields`` wrote (as read back from Redis, bytes or str)."""
        data = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()
        }
        return cls(
            engine_index=int(data["engine_index"]),
            kv_usage=float(data["kv_usage"]),
            running=int(data["running"]),
            waiting=int(data["waiting"]),
            waiting_deferred=int(data.get("waiting_deferred", 0)),
            running_adapters={k: int(v) for k, v in json.loads(data["running_adapters"]).items()},
            waiting_adapters={k: int(v) for k, v in json.loads(data["waiting_adapters"]).items()},
            preemptions_total=int(data["preemptions_total"]),
            prefix_cache_queries_total=int(data.get("prefix_cache_queries_total", 0)),
            prefix_cache_hits_total=int(data.get("prefix_cache_hits_total", 0)),
            steps=int(data.get("steps", 0)),
            metrics_read_at=float(data["metrics_read_at"]),
            pid=int(data.get("pid", 0)),
            started_at=float(data.get("started_at", 0.0)),
        )


class SnapshotBuilder:
    """Folds each ``record()`` call into the latest snapshot; cheap enough for the engine loop.

    Gauges (KV usage, running, waiting, adapters) come from the newest ``SchedulerStats``;
    ``record`` calls without one keep the previous gauges. Counters (preemptions, prefix-cache
    queries/hits) are summed over every call, so none is lost when the publisher skips
    intermediate snapshots.
    """

    def __init__(
        self,
        engine_index: int,
        pid: int,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine_index = engine_index
        self._pid = pid
        self._clock = wall_clock
        self._started_at = wall_clock()
        self._gauges: dict[str, Any] = {
            "kv_usage": 0.0, "running": 0, "waiting": 0, "waiting_deferred": 0,
            "running_adapters": {}, "waiting_adapters": {},
        }
        self._preemptions = 0
        self._queries = 0
        self._hits = 0
        self._steps = 0

    def update(self, scheduler_stats: Any, iteration_stats: Any) -> EngineSnapshot:
        """Fold one step's stats in and return the resulting snapshot."""
        self._steps += 1
        if scheduler_stats is not None:
            waiting = _int(scheduler_stats, "num_waiting_reqs")
            deferred = _int(scheduler_stats, "num_skipped_waiting_reqs")
            usage = getattr(scheduler_stats, "kv_cache_usage", 0.0)
            self._gauges = {
                "kv_usage": float(usage) if isinstance(usage, int | float) else 0.0,
                "running": _int(scheduler_stats, "num_running_reqs"),
                "waiting": waiting + deferred,
                "waiting_deferred": deferred,
                "running_adapters": _adapter_counts(scheduler_stats, "running_lora_adapters"),
                "waiting_adapters": _adapter_counts(scheduler_stats, "waiting_lora_adapters"),
            }
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                self._queries += _int(prefix, "queries")
                self._hits += _int(prefix, "hits")
        if iteration_stats is not None:
            self._preemptions += _int(iteration_stats, "num_preempted_reqs")
        return self.current()

    def current(self) -> EngineSnapshot:
        """The snapshot as of now, without folding in a step (an idle engine's state)."""
        return EngineSnapshot(
            engine_index=self._engine_index,
            preemptions_total=self._preemptions,
            prefix_cache_queries_total=self._queries,
            prefix_cache_hits_total=self._hits,
            steps=self._steps,
            metrics_read_at=self._clock(),
            pid=self._pid,
            started_at=self._started_at,
            **self._gauges,
        )
