"""Triage input from a running gateway's ``/metrics`` (one scrape, Prometheus text format).

What one scrape can tell, per route: TTFT and TPOT p95 (from the lifetime histograms), the
SLOs the route declares (``fleetgate_route_slo_seconds``), the prefix-repeat fraction, the
cache-busting flag, and how many distinct models the route sent traffic to. KV usage,
preemptions and utilisation need engine metrics or rates over time: use
``--prometheus`` for those, or fill them in with ``--input``.
"""

from __future__ import annotations

from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

from planning.triage.histogram import histogram_quantile
from planning.triage.model import (
    UNROUTED,
    MetricsError,
    RouteMetrics,
    SourceError,
    drop_undeclared_misses,
    scrubbed,
)


def fetch_gateway_metrics(url: str, client: httpx.Client) -> dict[str, RouteMetrics]:
    """Scrape ``url`` (a gateway base URL or its ``/metrics``) and read each route's metrics."""
    metrics_url = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
    try:
        response = client.get(metrics_url)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise SourceError(scrubbed(f"{metrics_url}: {exc}", url)) from exc
    return parse_gateway_metrics(response.text)


def parse_gateway_metrics(text: str) -> dict[str, RouteMetrics]:
    """Route name -> metrics from a gateway's exposition text."""
    # route -> le -> cumulative count, summed over the `model` label.
    ttft: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    tpot: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    repeat: dict[str, float] = {}
    busting: dict[str, bool] = {}
    models: dict[str, set[str]] = defaultdict(set)
    slos: dict[str, dict[str, float]] = defaultdict(dict)
    # route -> slo -> outcome -> requests (the gateway's exact SLO accounting).
    outcomes: dict[str, dict[str, dict[str, float]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(float))
    )
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise SourceError(f"not Prometheus exposition text: {exc}") from exc
    for family in families:
        for sample in family.samples:
            route = sample.labels.get("route")
            if route is None or route == UNROUTED:
                continue
            if sample.name == "fleetgate_ttft_seconds_bucket":
                ttft[route][float(sample.labels["le"])] += sample.value
            elif sample.name == "fleetgate_tpot_seconds_bucket":
                tpot[route][float(sample.labels["le"])] += sample.value
            elif sample.name == "fleetgate_prefix_repeat_fraction":
                repeat[route] = sample.value
            elif sample.name == "fleetgate_cache_busting_layout":
                busting[route] = sample.value >= 1
            elif sample.name == "fleetgate_requests_total" and sample.value > 0:
                models[route].add(sample.labels.get("model", ""))
            elif sample.name == "fleetgate_route_slo_seconds" and sample.value > 0:
                slos[route][sample.labels.get("slo", "")] = sample.value * 1000.0
            elif sample.name == "fleetgate_slo_requests_total":
                slo, outcome = sample.labels.get("slo", ""), sample.labels.get("outcome", "")
                outcomes[route][slo][outcome] += sample.value
    routes = sorted(set(ttft) | set(tpot) | set(repeat) | set(busting) | set(models))
    result = {}
    for route in routes:
        try:
            result[route] = RouteMetrics(**drop_undeclared_misses({
                "ttft_p95_ms": _p95_ms(ttft.get(route)),
                "ttft_slo_ms": slos[route].get("ttft"),
                "tpot_p95_ms": _p95_ms(tpot.get(route)),
                "tpot_slo_ms": slos[route].get("tpot"),
                "shared_prefix_fraction": repeat.get(route),
                "cache_busting_layout": busting.get(route),
                # Distinct models behind one route: fine-tunes deployed as full models.
                "fine_tuned_variants": len(models[route]) if route in models else None,
                "ttft_slo_missed": _missed(outcomes[route]["ttft"]),
                "tpot_slo_missed": _missed(outcomes[route]["tpot"]),
            }))
        except MetricsError as exc:
            raise SourceError(f"route {route}: {exc}") from exc
    return result


def _p95_ms(buckets: dict[float, float] | None) -> float | None:
    if not buckets:
        return None
    seconds = histogram_quantile(0.95, buckets.items())
    return None if seconds is None else seconds * 1000.0


def _missed(counts: dict[str, float]) -> float | None:
    """The share of requests that missed, of those counted (None: none counted)."""
    total = counts.get("met", 0.0) + counts.get("missed", 0.0)
    return counts.get("missed", 0.0) / total if total > 0 else None
