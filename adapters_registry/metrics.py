"""The adapter metrics of docs/metrics.md (section "Adapters"), in one small class.

Label values are server-controlled: ``adapter`` only ever holds catalogued names (requests for
unknown names are refused before anything is counted) and ``replica`` holds replica ids.
"""

from __future__ import annotations

import contextlib

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

#: Cold starts range from milliseconds (host cache) to a minute (large adapters from S3).
COLD_START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AdapterMetrics:
    """Counters, gauges and the cold-start histogram, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = REGISTRY if registry is None else registry
        self.requests = Counter(
            "fleetgate_adapter_requests_total", "Requests per catalogued adapter",
            ["adapter"], registry=reg,
        )
        self.loads = Counter(
            "fleetgate_adapter_loads_total", "Runtime adapter loads",
            ["adapter", "replica", "outcome"], registry=reg,
        )
        self.unloads = Counter(
            "fleetgate_adapter_unloads_total", "Runtime adapter unloads",
            ["adapter", "replica", "reason"], registry=reg,
        )
        self.cold_start = Histogram(
            "fleetgate_adapter_cold_start_seconds", "Time to load an adapter that was not resident",
            ["adapter"], buckets=COLD_START_BUCKETS, registry=reg,
        )
        self.slots_used = Gauge(
            "fleetgate_adapter_slots_used", "GPU LoRA slots in use", ["replica"], registry=reg,
        )
        self.thrash_events = Counter(
            "fleetgate_adapter_thrash_events_total", "Loads refused by the thrash guard",
            ["replica"], registry=reg,
        )

    def request(self, adapter: str) -> None:
        """One request for ``adapter``."""
        self.requests.labels(adapter=adapter).inc()

    def load(self, adapter: str, replica: str, ok: bool, seconds: float | None = None) -> None:
        """One load attempt; a successful one also observes its cold-start time."""
        self.loads.labels(adapter=adapter, replica=replica, outcome="ok" if ok else "failed").inc()
        if ok and seconds is not None:
            self.cold_start.labels(adapter=adapter).observe(seconds)

    def unload(self, adapter: str, replica: str, reason: str) -> None:
        """One unload (``lru``, ``admin`` or ``prewarm``)."""
        self.unloads.labels(adapter=adapter, replica=replica, reason=reason).inc()

    def set_slots_used(self, replica: str, used: int) -> None:
        """GPU LoRA slots in use on ``replica``."""
        self.slots_used.labels(replica=replica).set(used)

    def thrash_event(self, replica: str) -> None:
        """A load refused by the thrash guard."""
        self.thrash_events.labels(replica=replica).inc()

    def forget_replica(self, replica: str) -> None:
        """Drop the slot gauge of a replica that left (its counters keep their history)."""
        with contextlib.suppress(KeyError):
            self.slots_used.remove(replica)
