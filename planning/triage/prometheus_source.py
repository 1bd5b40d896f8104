"""Triage input from Prometheus: PromQL over its HTTP API, rates over a window.

Per-route signals come from the gateway's metrics; KV usage, preemptions, the waiting queue and
utilisation are fleet-wide (engines are shared by routes) and apply to every route.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import httpx

from planning.triage.model import UNROUTED, MetricsError, RouteMetrics, SourceError

#: field -> PromQL, ``{w}`` is the window. Per-route queries aggregate ``by (route)``.
ROUTE_QUERIES: dict[str, str] = {
    "ttft_p95_ms": (
        "1000 * histogram_quantile(0.95, sum by (route, le) "
        "(rate(fleetgate_ttft_seconds_bucket[{w}])))"
    ),
    "tpot_p95_ms": (
        "1000 * histogram_quantile(0.95, sum by (route, le) "
        "(rate(fleetgate_tpot_seconds_bucket[{w}])))"
    ),
    # What each route declares in the policy (absent where it declares none).
    "ttft_slo_ms": 'max by (route) (1000 * fleetgate_route_slo_seconds{{slo="ttft"}})',
    "tpot_slo_ms": 'max by (route) (1000 * fleetgate_route_slo_seconds{{slo="tpot"}})',
    "shared_prefix_fraction": (
        "max by (route) (avg_over_time(fleetgate_prefix_repeat_fraction[{w}]))"
    ),
    "cache_busting_layout": "max by (route) (max_over_time(fleetgate_cache_busting_layout[{w}]))",
    "fine_tuned_variants": (
        "count by (route) (sum by (route, model) (rate(fleetgate_requests_total[{w}])) > 0)"
    ),
}
FLEET_QUERIES: dict[str, str] = {
    # The fullest replica is the one that preempts; average over the window, max over replicas.
    "kv_cache_usage": "max(avg_over_time(vllm:kv_cache_usage_perc[{w}]))",
    "preemptions_per_min": "60 * sum(rate(vllm:num_preemptions_total[{w}]))",
    "waiting_mean": "avg(avg_over_time(vllm:num_requests_waiting[{w}]))",
    # Queue growth per replica per minute, as `fleetgate advise --prometheus` reads it.
    "waiting_growth_per_min": "60 * avg(deriv(vllm:num_requests_waiting[{w}]))",
    # Replica-seconds attributed to requests per second of wall time, per healthy replica.
    "utilisation": (
        "sum(rate(fleetgate_replica_seconds_total[{w}])) / "
        "count(count by (replica) (fleetgate_replica_healthy == 1))"
    ),
}

_SLO_FIELDS = frozenset({"ttft_slo_ms", "tpot_slo_ms"})

_CONVERT: dict[str, Callable[[float], object]] = {
    "cache_busting_layout": lambda value: value >= 1,
    "fine_tuned_variants": lambda value: int(value),
    # Utilisation above 1 means overlapping requests per replica; triage reads it as saturated.
    "utilisation": lambda value: min(value, 1.0),
}


def query(client: httpx.Client, base_url: str, promql: str) -> list[tuple[dict[str, str], float]]:
    """Run an instant query; returns (labels, value) for each series with a finite value."""
    url = base_url.rstrip("/") + "/api/v1/query"
    try:
        response = client.get(url, params={"query": promql})
        body = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SourceError(f"{url}: {exc}") from exc
    if body.get("status") != "success":
        raise SourceError(
            f"{url}: query failed ({body.get('error', response.status_code)}): {promql}"
        )
    series = []
    for item in body["data"]["result"]:
        value = float(item["value"][1])
        if math.isfinite(value):  # histogram_quantile gives NaN for routes with no traffic
            series.append((item["metric"], value))
    return series


def fetch_prometheus_metrics(
    base_url: str, client: httpx.Client, window: str = "10m"
) -> dict[str, RouteMetrics]:
    """Route name -> metrics over the last ``window`` (a PromQL duration such as ``10m``)."""
    per_route: dict[str, dict[str, object]] = {}
    for field, template in ROUTE_QUERIES.items():
        for labels, value in query(client, base_url, template.format(w=window)):
            route = labels.get("route")
            if route is not None and route != UNROUTED:
                per_route.setdefault(route, {})[field] = _CONVERT.get(field, float)(value)
    # A route that declares SLOs but saw no traffic in the window has nothing to triage.
    per_route = {route: v for route, v in per_route.items() if set(v) - _SLO_FIELDS}
    fleet: dict[str, object] = {}
    for field, template in FLEET_QUERIES.items():
        results = query(client, base_url, template.format(w=window))
        if results:
            fleet[field] = _CONVERT.get(field, float)(results[0][1])
    try:
        return {
            route: RouteMetrics(**(values | fleet)) for route, values in sorted(per_route.items())
        }
    except MetricsError as exc:
        raise SourceError(f"{base_url}: {exc}") from exc
