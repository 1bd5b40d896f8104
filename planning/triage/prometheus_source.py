"""Triage input from Prometheus: PromQL over its HTTP API, rates over a window.

Per-route signals come from the gateway's metrics; KV usage, preemptions, the waiting queue and
utilisation are fleet-wide (engines are shared by routes) and apply to every route.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from planning.triage.model import (
    UNROUTED,
    MetricsError,
    RouteMetrics,
    SourceError,
    drop_undeclared_misses,
    scrubbed,
)

#: field -> PromQL: ``{w}`` is the window, ``{s}`` the ``--selector`` label matchers every series
#: is read with (empty: all; PromQL takes ``metric{}`` and a trailing comma in a matcher list).
#: Per-route queries aggregate ``by (route)``.
ROUTE_QUERIES: dict[str, str] = {
    "ttft_p95_ms": (
        "1000 * histogram_quantile(0.95, sum by (route, le) "
        "(rate(fleetgate_ttft_seconds_bucket{{{s}}}[{w}])))"
    ),
    "tpot_p95_ms": (
        "1000 * histogram_quantile(0.95, sum by (route, le) "
        "(rate(fleetgate_tpot_seconds_bucket{{{s}}}[{w}])))"
    ),
    # What each route declares in the policy (absent where it declares none).
    "ttft_slo_ms": 'max by (route) (1000 * fleetgate_route_slo_seconds{{slo="ttft",{s}}})',
    "tpot_slo_ms": 'max by (route) (1000 * fleetgate_route_slo_seconds{{slo="tpot",{s}}})',
    "shared_prefix_fraction": (
        "max by (route) (avg_over_time(fleetgate_prefix_repeat_fraction{{{s}}}[{w}]))"
    ),
    "cache_busting_layout": (
        "max by (route) (max_over_time(fleetgate_cache_busting_layout{{{s}}}[{w}]))"
    ),
    "fine_tuned_variants": (
        "count by (route) (sum by (route, model) (rate(fleetgate_requests_total{{{s}}}[{w}])) > 0)"
    ),
    # The gateway's exact SLO accounting: the verdict, where the p95 above is interpolated
    # inside histogram buckets (a 280 ms SLO in a 150-300 ms bucket read as breached).
    "ttft_slo_missed": (
        "sum by (route) (increase(fleetgate_slo_requests_total"
        '{{slo="ttft",outcome="missed",{s}}}[{w}])) / sum by (route) '
        '(increase(fleetgate_slo_requests_total{{slo="ttft",{s}}}[{w}]))'
    ),
    "tpot_slo_missed": (
        "sum by (route) (increase(fleetgate_slo_requests_total"
        '{{slo="tpot",outcome="missed",{s}}}[{w}])) / sum by (route) '
        '(increase(fleetgate_slo_requests_total{{slo="tpot",{s}}}[{w}]))'
    ),
}
FLEET_QUERIES: dict[str, str] = {
    # The fullest replica is the one that preempts; average over the window, max over replicas.
    "kv_cache_usage": "max(avg_over_time(vllm:kv_cache_usage_perc{{{s}}}[{w}]))",
    "preemptions_per_min": "60 * sum(rate(vllm:num_preemptions_total{{{s}}}[{w}]))",
    "waiting_mean": "avg(avg_over_time(vllm:num_requests_waiting{{{s}}}[{w}]))",
    # Queue growth per replica per minute, as `fleetgate advise --prometheus` reads it.
    "waiting_growth_per_min": "60 * avg(deriv(vllm:num_requests_waiting{{{s}}}[{w}]))",
    # Standard requests flow control refused for saturation, of those it decided (a queued
    # one is decided once more when it leaves the queue: admitted, shed, abandoned or failed).
    # Sheddable ones are refused by design under overload; critical ones never are.
    "shed_share": (
        "sum(increase(fleetgate_flow_decisions_total"
        '{{request_class="standard",decision="shed",reason!="token_budget",{s}}}[{w}])) / '
        "sum(increase(fleetgate_flow_decisions_total"
        '{{request_class="standard",decision!="queue",{s}}}[{w}]))'
    ),
    # Replica-seconds attributed to requests per second of wall time, per healthy replica.
    "utilisation": (
        "sum(rate(fleetgate_replica_seconds_total{{{s}}}[{w}])) / "
        "count(count by (replica) (fleetgate_replica_healthy{{{s}}} == 1))"
    ),
}
#: How far back the gateway's series reach within the window (seconds): a window longer than
#: the data dilutes every rate over it.
COVERAGE_QUERY = "time() - min(min_over_time(timestamp(fleetgate_replica_healthy{{{s}}})[{w}:]))"

#: Fields only a route with requests in the window has.
_TRAFFIC_FIELDS = frozenset({"ttft_p95_ms", "tpot_p95_ms", "fine_tuned_variants"})

_CONVERT: dict[str, Callable[[float], object]] = {
    "cache_busting_layout": lambda value: value >= 1,
    "fine_tuned_variants": lambda value: int(value),
    # Utilisation above 1 means overlapping requests per replica; triage reads it as saturated.
    "utilisation": lambda value: min(value, 1.0),
}


def query(client: httpx.Client, base_url: str, promql: str) -> list[tuple[dict[str, str], float]]:
    """Run an instant query; returns (labels, value) for each series with a finite value."""
    url = base_url.rstrip("/") + "/api/v1/query"
    shown = scrubbed(url, base_url)
    try:
        response = client.get(url, params={"query": promql})
    except httpx.HTTPError as exc:
        raise SourceError(scrubbed(f"{shown}: {exc}", base_url)) from exc
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        # Not Prometheus's JSON: an auth proxy's 401, a wrong path's 404 page.
        hint = {
            401: " (unauthorised: check the user and password in the URL)"
            if urlsplit(base_url).password
            else " (unauthorised: put the user and password in the URL, http://USER:PASS@host)",
            403: " (forbidden)",
            404: " (not found: is this a Prometheus base URL, without /api/v1?)",
        }.get(response.status_code, "")
        raise SourceError(
            f"{shown}: HTTP {response.status_code} {response.reason_phrase}{hint}, not "
            "Prometheus's JSON answer"
        )
    if body.get("status") != "success":
        raise SourceError(
            f"{shown}: query failed ({body.get('error', response.status_code)}): {promql}"
        )
    series = []
    for item in body["data"]["result"]:
        value = float(item["value"][1])
        if math.isfinite(value):  # histogram_quantile gives NaN for routes with no traffic
            series.append((item["metric"], value))
    return series


def fetch_prometheus_metrics(
    base_url: str, client: httpx.Client, window: str = "10m", selector: str = ""
) -> dict[str, RouteMetrics]:
    """Route name -> metrics over the last ``window`` (a PromQL duration such as ``10m``), of
    the series that match ``selector`` (label matchers such as ``namespace="prod"``; empty:
    all)."""
    per_route: dict[str, dict[str, object]] = {}
    for field, template in ROUTE_QUERIES.items():
        for labels, value in query(client, base_url, template.format(w=window, s=selector)):
            route = labels.get("route")
            if route is not None and route != UNROUTED:
                per_route.setdefault(route, {})[field] = _CONVERT.get(field, float)(value)
    # A route that saw no traffic in the window has nothing to triage (its declared SLOs and
    # the gauges it set earlier stay: they do not make it a route with requests).
    per_route = {route: v for route, v in per_route.items() if set(v) & _TRAFFIC_FIELDS}
    for values in per_route.values():
        drop_undeclared_misses(values)
    fleet: dict[str, object] = {}
    for field, template in FLEET_QUERIES.items():
        results = query(client, base_url, template.format(w=window, s=selector))
        if results:
            fleet[field] = _CONVERT.get(field, float)(results[0][1])
    try:
        return {
            route: RouteMetrics(**(values | fleet)) for route, values in sorted(per_route.items())
        }
    except MetricsError as exc:
        raise SourceError(f"{scrubbed(base_url, base_url)}: {exc}") from exc


def window_coverage_s(
    base_url: str, client: httpx.Client, window: str, selector: str = ""
) -> float | None:
    """Seconds of the window the gateway's series cover (None: no series at all)."""
    results = query(client, base_url, COVERAGE_QUERY.format(w=window, s=selector))
    return results[0][1] if results else None
