"""Prometheus metrics of the gateway's index mirror (``index.mode: mirror``), read at scrape time.

A mirror that fell behind its streams' cap reloads replicas, and one that saw Redis lose its
data rebuilds: both show here (``docs/index.md``, mirror mode), beside whether it is ready and
connected (when not, decisions are load-only and ``fleetgate_degraded_total`` counts them).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from routing.index.mirror import MirrorBlockIndex

__all__ = ["MirrorCollector"]


class MirrorCollector(Collector):
    """Exports one mirror's follow counters (no labels but ``reason``: low cardinality)."""

    def __init__(self, mirror: MirrorBlockIndex) -> None:
        self._mirror = mirror

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counters = self._mirror.follow_counters()
        yield GaugeMetricFamily(
            "fleetgate_index_mirror_ready",
            "1 once the index mirror has bootstrapped (0: starting or rebuilding, load-only)",
            value=1 if counters.ready else 0,
        )
        yield GaugeMetricFamily(
            "fleetgate_index_mirror_connected",
            "1 while the index mirror's stream tail reaches Redis (0: load-only)",
            value=1 if counters.connected else 0,
        )
        yield CounterMetricFamily(
            "fleetgate_index_mirror_events_applied",
            "Stream events the index mirror applied",
            value=counters.events_applied,
        )
        reloads = CounterMetricFamily(
            "fleetgate_index_mirror_replica_reloads",
            "Replicas reloaded from their Redis snapshot: gap (events missed, e.g. behind the "
            "stream cap) or store_reset (Redis lost the replica's keys)",
            labels=["reason"],
        )
        for reason in ("gap", "store_reset"):
            reloads.add_metric([reason], counters.replica_reloads.get(reason, 0))
        yield reloads
        yield CounterMetricFamily(
            "fleetgate_index_mirror_rebuilds",
            "Full rebuilds after Redis lost the index (flush, restart without persistence)",
            value=counters.rebuilds,
        )
        yield CounterMetricFamily(
            "fleetgate_index_mirror_tail_errors",
            "Failed reads of the index streams (Redis unreachable)",
            value=counters.tail_errors,
        )
