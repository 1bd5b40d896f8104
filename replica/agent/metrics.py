"""The agent's own Prometheus metrics (names and labels as in docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

# No ``*_created`` series, as on the gateway (docs/metrics.md): process-wide, at import.
disable_created_metrics()


class AgentMetrics:
    """Every ``fleetgate_agent_*`` metric of one agent, in a private registry.

    A private registry (not the process-global one) lets tests run several agents in one process
    and lets ``fleetgate replica run`` serve exactly these on the agent's ``/metrics``.
    """

    def __init__(self, replica: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.replica = replica
        labels = ["replica"]
        self._events = Counter(
            "fleetgate_agent_events_applied_total", "KV events applied to the index",
            [*labels, "type"], registry=self.registry,
        )
        self._lag = Gauge(
            "fleetgate_agent_event_lag_seconds",
            "Now minus the engine timestamp of the last applied batch", labels,
            registry=self.registry,
        )
        self._gaps = Counter(
            "fleetgate_agent_event_gaps_total", "Gaps in the event sequence", labels,
            registry=self.registry,
        )
        self._replays = Counter(
            "fleetgate_agent_replays_total", "Replay requests", [*labels, "outcome"],
            registry=self.registry,
        )
        self._retirements = Counter(
            "fleetgate_agent_epoch_retirements_total", "Epochs retired", [*labels, "reason"],
            registry=self.registry,
        )
        self._redis_errors = Counter(
            "fleetgate_agent_redis_errors_total", "Failed writes to Redis", labels,
            registry=self.registry,
        )
        self._index_lost = Counter(
            "fleetgate_agent_index_lost_total",
            "Heartbeats that found Redis had forgotten the replica's epoch (flushed, restarted "
            "empty): the agent re-publishes its engine's blocks under a new epoch",
            labels,
            registry=self.registry,
        )
        self._engine_up = Gauge(
            "fleetgate_agent_engine_up", "1 when the engine's /health answers", labels,
            registry=self.registry,
        )
        self._index_behind = Gauge(
            "fleetgate_agent_index_behind",
            "1 while the index may miss what the engine holds (a Redis write failed, or Redis "
            "lost the entries) until a resync re-records it: the applied-events counter and the "
            "lag say nothing then",
            labels,
            registry=self.registry,
        )
        self._scrape = Histogram(
            "fleetgate_agent_metrics_scrape_seconds", "Time to scrape the engine's /metrics",
            labels, registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        # Counters the dashboard and alerts take increase()/rate() of exist from the start, at 0:
        # a series born at 1 shows "No data" until then and its first event is never counted.
        self._gaps.labels(replica)
        self._redis_errors.labels(replica)

    def event_applied(self, kind: str) -> None:
        """One event of ``kind`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)."""
        self._events.labels(self.replica, kind).inc()

    def batch_lag(self, lag_s: float) -> None:
        self._lag.labels(self.replica).set(lag_s)

    def gap(self) -> None:
        self._gaps.labels(self.replica).inc()

    def replay(self, ok: bool) -> None:
        self._replays.labels(self.replica, "ok" if ok else "failed").inc()

    def epoch_retired(self, reason: str) -> None:
        """``reason``: ``cleared``, ``gap``, ``restart`` or ``resync`` (after a Redis outage)."""
        self._retirements.labels(self.replica, reason).inc()

    def redis_error(self) -> None:
        self._redis_errors.labels(self.replica).inc()

    def index_lost(self) -> None:
        self._index_lost.labels(self.replica).inc()

    def index_behind(self, read: Callable[[], bool]) -> None:
        """Read at each scrape whether the index is behind the engine (``read``)."""
        self._index_behind.labels(self.replica).set_function(lambda: 1.0 if read() else 0.0)

    def engine_up(self, up: bool) -> None:
        self._engine_up.labels(self.replica).set(1 if up else 0)

    def scrape_seconds(self, seconds: float) -> None:
        self._scrape.labels(self.replica).observe(seconds)

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (tests and ``/health`` read it); 0 if never set."""
        found = self.registry.get_sample_value(name, {"replica": self.replica, **labels})
        return 0.0 if found is None else found
