"""What ``/dashboard/data`` answers: typed rows built from the same samples ``/metrics`` renders.

Per route (the gateway's registry): requests, request rate, prefix hit rate, cost per 1M tokens,
goodput, and the queue / TTFT / ITL / TPOT timers at p50/p95/p99. Per pool (the engines' own
``/metrics``): the four gauges and four timers ``fleetgate advise`` reads. Per replica: health,
circuit, KV usage, queue, adapters. The last routing decisions and the layout warnings.
Rates and percentiles cover the last ``window_s`` (or since start, when the gateway is younger).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.dashboard.engines import EngineSample, read_engines
from gateway.dashboard.histograms import (
    SampleWindow,
    Snapshot,
    histogram_quantile,
    in_first_bucket,
    snapshot,
)
from gateway.health import refresh_gauges
from gateway.state import GatewayState

QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
#: Gateway timers per route: page name -> histogram (docs/metrics.md).
ROUTE_TIMERS = {
    "queue": "fleetgate_queue_time_seconds",
    "ttft": "fleetgate_ttft_seconds",
    "itl": "fleetgate_itl_seconds",
    "tpot": "fleetgate_tpot_seconds",
}
#: Engine timers per pool, as vLLM names them (prefill: vLLM's own timer).
POOL_TIMERS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}
DECISIONS_SHOWN = 12
#: Engine ``/metrics`` reads younger than this are reused: several open pages, one read.
ENGINE_READ_REUSE_S = 1.0


@dataclass(frozen=True)
class Percentiles:
    """A timer's p50/p95/p99 in seconds over the window; None where it has no observation."""

    p50: float | None
    p95: float | None
    p99: float | None
    count: float
    #: Quantiles (``"p50"`` ...) in the histogram's first bucket: the value is that bucket's
    #: bound, an upper bound only (the page prints it as ``<=N``).
    at_most: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouteRow:
    route: str
    #: ``sum(fleetgate_requests_total{route})`` since the gateway started, as /metrics has it.
    requests_total: float
    requests_per_s: float
    #: ``fleetgate_prefix_hit_rate{route}`` (cached / prompt tokens, the gateway's window).
    prefix_hit_rate: float | None
    cost_per_1m_tokens_usd: float | None
    #: Share of requests that met both SLOs, over the window.
    goodput: float | None
    timers: dict[str, Percentiles]
    cache_busting_layout: bool


@dataclass(frozen=True)
class PoolRow:
    pool: str
    replicas: int
    kv_usage_max: float | None
    waiting: float | None
    running: float | None
    preemptions_per_min: float | None
    prefix_hit_rate: float | None
    timers: dict[str, Percentiles]


@dataclass(frozen=True)
class ReplicaRow:
    replica: str
    pool: str
    healthy: bool
    circuit: str
    kv_usage: float
    running: int
    waiting: int
    inflight: int
    loaded_adapters: list[str]
    max_loras: int | None
    #: None: the engine's figures were never read.
    staleness_s: float | None
    metrics_readable: bool


@dataclass(frozen=True)
class DecisionRow:
    at: float
    route: str
    model: str
    adapter: str | None
    replica: str
    profile: str
    prompt_tokens: int
    degraded: bool
    last_resort: bool
    decision_ms: float | None
    #: Candidate replica -> matched blocks, plugin scores, the filter that removed it.
    candidates: list[dict[str, Any]]


@dataclass(frozen=True)
class LayoutRow:
    route: str
    requests: int
    prefix_repeat_fraction: float
    cache_busting_layout: bool
    advice: str | None


@dataclass(frozen=True)
class DashboardData:
    generated_at: float
    window_s: float
    routes: list[RouteRow]
    pools: list[PoolRow]
    replicas: list[ReplicaRow]
    decisions: list[DecisionRow]
    layout: list[LayoutRow]
    warnings: list[str] = field(default_factory=list)


class DashboardSource:
    """Builds ``DashboardData``; keeps the snapshots its windows subtract."""

    def __init__(self, window_s: float = 300.0, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._gateway = SampleWindow(window_s, clock())
        self._engines = SampleWindow(window_s, clock())
        self._engine_read: tuple[float, list[EngineSample], set[str]] | None = None
        self._engine_lock = asyncio.Lock()

    async def build(self, gw: GatewayState) -> DashboardData:
        refresh_gauges(gw)  # exactly what a /metrics scrape does first
        now = self._clock()
        current = _registry_snapshot(gw, now)
        window = self._gateway.add(current)
        samples, unreadable = await self._read_engines(gw)
        engines_now = snapshot(now, ((s.name, s.labels, s.value) for s in samples))
        engine_window = self._engines.add(engines_now)
        layout = [
            LayoutRow(
                r.route, r.requests, r.prefix_repeat_fraction, r.cache_busting_layout, r.advice
            )
            for r in gw.layout.reports()
        ]
        busting = {row.route for row in layout if row.cache_busting_layout}
        warnings = [f"route {row.route}: {row.advice or 'cache-busting prompt layout'}"
                    for row in layout if row.cache_busting_layout]
        warnings += [f"replica {rid}: its /metrics did not answer" for rid in sorted(unreadable)]
        return DashboardData(
            generated_at=time.time(),
            window_s=round(window.at, 1),
            routes=_routes(gw, current, window, busting),
            pools=_pools(gw, engines_now, engine_window),
            replicas=_replicas(gw, unreadable),
            decisions=_decisions(gw),
            layout=layout,
            warnings=warnings,
        )


    async def _read_engines(self, gw: GatewayState) -> tuple[list[EngineSample], set[str]]:
        async with self._engine_lock:
            last = self._engine_read
            if last is not None and self._clock() - last[0] < ENGINE_READ_REUSE_S:
                return last[1], last[2]
            samples: list[EngineSample] = []
            unreadable: set[str] = set()
            if gw.session is not None:
                samples, unreadable = await read_engines(gw.session, gw.registry.all())
            self._engine_read = (self._clock(), samples, unreadable)
            return samples, unreadable


def _registry_snapshot(gw: GatewayState, now: float) -> Snapshot:
    samples = (
        (sample.name, sample.labels, sample.value)
        for family in gw.metrics.registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    )
    return snapshot(now, samples)


def _percentiles(buckets: list[tuple[float, float]] | None) -> Percentiles:
    buckets = buckets or []
    values = {name: histogram_quantile(q, buckets) for name, q in QUANTILES}
    at_most = tuple(name for name, q in QUANTILES if in_first_bucket(q, buckets))
    for name in at_most:
        values[name] = buckets[0][0]
    count = buckets[-1][1] if buckets else 0.0
    return Percentiles(values["p50"], values["p95"], values["p99"], count, at_most)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not denominator or numerator is None:
        return None
    return numerator / denominator


def _routes(
    gw: GatewayState, current: Snapshot, window: Snapshot, busting: set[str]
) -> list[RouteRow]:
    totals = current.sum_by("fleetgate_requests_total", "route")
    in_window = window.sum_by("fleetgate_requests_total", "route")
    hit_rate = current.sum_by("fleetgate_prefix_hit_rate", "route")
    cost = current.sum_by("fleetgate_cost_per_1m_tokens_usd", "route")
    met = window.sum_by("fleetgate_slo_requests_total", "route", slo="all", outcome="met")
    checked = window.sum_by("fleetgate_slo_requests_total", "route", slo="all")
    timers = {name: window.buckets_by(metric, "route") for name, metric in ROUTE_TIMERS.items()}
    configured = [r.name for r in gw.policy.routes]
    names = configured + sorted(set(totals) - set(configured))
    return [
        RouteRow(
            route=name,
            requests_total=totals.get(name, 0.0),
            requests_per_s=in_window.get(name, 0.0) / window.at if window.at > 0 else 0.0,
            prefix_hit_rate=hit_rate.get(name),
            cost_per_1m_tokens_usd=cost.get(name),
            goodput=_ratio(met.get(name), checked.get(name)),
            timers={t: _percentiles(by_route.get(name)) for t, by_route in timers.items()},
            cache_busting_layout=name in busting,
        )
        for name in names
    ]


def _pools(gw: GatewayState, current: Snapshot, window: Snapshot) -> list[PoolRow]:
    replicas: dict[str, int] = {}
    for state in gw.registry.all():
        replicas[state.pool] = replicas.get(state.pool, 0) + 1
    kv = _max_by(current, "vllm:kv_cache_usage_perc")
    waiting = current.sum_by("vllm:num_requests_waiting", "pool")
    running = current.sum_by("vllm:num_requests_running", "pool")
    preempted = window.sum_by("vllm:num_preemptions_total", "pool")
    hits = window.sum_by("vllm:prefix_cache_hits_total", "pool")
    queries = window.sum_by("vllm:prefix_cache_queries_total", "pool")
    timers = {name: window.buckets_by(metric, "pool") for name, metric in POOL_TIMERS.items()}
    return [
        PoolRow(
            pool=pool,
            replicas=count,
            kv_usage_max=kv.get(pool),
            waiting=waiting.get(pool),
            running=running.get(pool),
            preemptions_per_min=(
                60 * preempted[pool] / window.at if pool in preempted and window.at > 0 else None
            ),
            prefix_hit_rate=_ratio(hits.get(pool), queries.get(pool)),
            timers={t: _percentiles(by_pool.get(pool)) for t, by_pool in timers.items()},
        )
        for pool, count in sorted(replicas.items())
    ]


def _max_by(current: Snapshot, name: str) -> dict[str, float]:
    """``max by (pool) (name)``."""
    out: dict[str, float] = {}
    for (sample, labels), value in current.values.items():
        if sample == name:
            pool = dict(labels).get("pool", "")
            out[pool] = max(out.get(pool, value), value)
    return out


def _replicas(gw: GatewayState, unreadable: set[str]) -> list[ReplicaRow]:
    counts = gw.inflight.counts()
    return [
        ReplicaRow(
            replica=str(s.replica_id),
            pool=s.pool,
            healthy=s.healthy,
            circuit=gw.registry.breaker(s.replica_id).state.value,
            kv_usage=s.kv_usage,
            running=s.running,
            waiting=s.waiting,
            inflight=counts.get(s.replica_id, (0, 0))[0],
            loaded_adapters=sorted(s.loaded_adapters),
            max_loras=s.max_loras,
            staleness_s=s.shown_staleness_s(),
            metrics_readable=str(s.replica_id) not in unreadable,
        )
        for s in gw.registry.all()
    ]


def _decisions(gw: GatewayState) -> list[DecisionRow]:
    rows = []
    for entry in list(gw.decisions)[-DECISIONS_SHOWN:][::-1]:
        candidates = [
            {
                "replica": str(rid),
                "matched_blocks": e.matched_blocks,
                "scores": {k: round(v, 4) for k, v in dict(e.scores).items()},
                "filtered_out_by": e.filtered_out_by,
            }
            for rid, e in entry.explanations.items()
        ]
        timings = entry.timings_ms
        rows.append(
            DecisionRow(
                at=entry.at,
                route=entry.route,
                model=entry.model,
                adapter=entry.adapter,
                replica=str(entry.replica),
                profile=entry.profile,
                prompt_tokens=entry.prompt_tokens,
                degraded=entry.degraded,
                last_resort=entry.last_resort,
                decision_ms=timings.get("total"),
                candidates=candidates,
            )
        )
    return rows
