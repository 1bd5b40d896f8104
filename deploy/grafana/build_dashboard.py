"""Build the fleetgate Grafana dashboard JSON from a short panel list (dashboard as code).

Run ``python deploy/grafana/build_dashboard.py`` after editing; it rewrites
``deploy/grafana/fleetgate-dashboard.json`` next to this file, and a test checks that the committed
JSON is what this script produces and that every metric it queries is exported by fleetgate or vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("fleetgate-dashboard.json")
RATE = "5m"


def _quantile(q: float, metric: str, by: str = "route") -> str:
    return (
        f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RATE}])))"
    )


def _percentiles(metric: str, by: str = "route") -> list[tuple[str, str]]:
    """p50, p95 and p99 of a histogram, one target each, per ``by``."""
    legend = "{{" + by + "}}"
    return [(f"p{round(q * 100)} {legend}", _quantile(q, metric, by)) for q in (0.5, 0.95, 0.99)]


def _mean(metric: str, by: str = "pool") -> str:
    """A histogram's mean over the range. For vLLM's queue and prefill timers, whose first
    bucket is 0-0.3 s, percentiles would be interpolated inside it: p50 0.15 s and p95 0.285 s
    on every healthy fleet, whatever the real times."""
    return _ratio(f"{metric}_sum", f"{metric}_count", by)


def _share_over(metric: str, le: str, by: str = "pool") -> str:
    """The share of a histogram's observations over its bucket ``le``."""
    return (
        f"1 - sum by ({by}) (rate({metric}_bucket{{le=\"{le}\"}}[{RATE}]))"
        f" / (sum by ({by}) (rate({metric}_count[{RATE}])) > 0)"
    )


def _ratio(num: str, den: str, by: str = "route") -> str:
    # No traffic in the range is no series, not a NaN one (0 / 0) beside the others.
    return f"sum by ({by}) (rate({num}[{RATE}])) / (sum by ({by}) (rate({den}[{RATE}])) > 0)"


#: USD per 1M tokens per route, fleet-wide: each pool's bill (per second) split among routes by
#: the replica-seconds they were charged there (summed over pods), over the route's tokens.
_FLEET_COST_PER_1M = (
    "sum by (route) ("
    f"sum by (route, pool) (rate(fleetgate_replica_seconds_total[{RATE}]))"
    # A pool idle over the whole range divides 0 by 0: left out, not NaN for every route.
    " / on (pool) group_left ()"
    f" (sum by (pool) (rate(fleetgate_replica_seconds_total[{RATE}])) > 0)"
    " * on (pool) group_left () max by (pool) (fleetgate_pool_bill_usd_per_hour) / 3600"
    ") / ("
    f"sum by (route) (rate(fleetgate_prompt_tokens_total[{RATE}]))"
    f" + sum by (route) (rate(fleetgate_completion_tokens_total[{RATE}]))"
    ") * 1e6"
)

#: (row title, [(panel title, unit, [(legend, expr)])])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Routes", [
        ("Prefix hit rate (cached / prompt tokens)", "percentunit", [
            ("{{route}}", _ratio("fleetgate_cached_tokens_total", "fleetgate_prompt_tokens_total")),
        ]),
        # Fleet-wide, from counters every pod adds to: each pod's own gauge charges the whole
        # pool bill to its own traffic, N times the truth with N pods (docs/cost.md).
        ("Cost per 1M tokens", "currencyUSD", [
            ("{{route}}", _FLEET_COST_PER_1M),
        ]),
        # Failed requests (5xx, timeouts) count as misses: goodput falls when requests fail.
        ("Goodput (share of requests served within their TTFT and TPOT SLOs)", "percentunit", [
            ("{{route}}", _ratio('fleetgate_slo_requests_total{slo="all",outcome="met"}',
                                'fleetgate_slo_requests_total{slo="all"}')),
        ]),
        ("TTFT p50 / p95 / p99", "s", _percentiles("fleetgate_ttft_seconds")),
        ("TPOT p50 / p95 / p99", "s", _percentiles("fleetgate_tpot_seconds")),
        ("ITL p50 / p95 / p99", "s", _percentiles("fleetgate_itl_seconds")),
        # Arrival to upstream send: routing, flow-control waits and adapter loads (to 120 s).
        ("Gateway queue time p50 / p95 / p99 (routing, flow control, adapter loads)", "s",
         _percentiles("fleetgate_queue_time_seconds")),
        ("Requests by status", "reqps", [
            ("{{status}}", f"sum by (status) (rate(fleetgate_requests_total[{RATE}]))"),
        ]),
        ("Errors by code", "reqps", [
            ("{{code}}", f"sum by (code) (rate(fleetgate_errors_total[{RATE}]))"),
        ]),
    ]),
    # The eight numbers `fleetgate advise` reads (docs/advise.md), per pool: engines carry the
    # pool label through the scrape relabelling (deploy/base/servicemonitors.yaml).
    ("Pools: what fleetgate advise reads", [
        ("KV cache usage (fullest replica)", "percentunit", [
            ("{{pool}}", "max by (pool) (vllm:kv_cache_usage_perc)"),
        ]),
        ("Requests waiting", "short", [("{{pool}}", "sum by (pool) (vllm:num_requests_waiting)")]),
        ("Preemptions per minute", "short", [
            ("{{pool}}", f"60 * sum by (pool) (rate(vllm:num_preemptions_total[{RATE}]))"),
        ]),
        ("Engine prefix-cache hit rate", "percentunit", [
            ("{{pool}}", _ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                                by="pool")),
        ]),
        # vLLM's buckets for these two start at 0.3 s: a mean, and the share past 0.3 s.
        ("Engine queue and prefill time (means; vLLM's own timers)", "s", [
            ("queue {{pool}}", _mean("vllm:request_queue_time_seconds")),
            ("prefill {{pool}}", _mean("vllm:request_prefill_time_seconds")),
        ]),
        ("Requests whose engine queue / prefill time passed 0.3 s", "percentunit", [
            ("queue {{pool}}", _share_over("vllm:request_queue_time_seconds", "0.3")),
            ("prefill {{pool}}", _share_over("vllm:request_prefill_time_seconds", "0.3")),
        ]),
        ("Engine TTFT p50 / p95 / p99", "s",
         _percentiles("vllm:time_to_first_token_seconds", by="pool")),
        ("Engine ITL p50 / p95 / p99", "s",
         _percentiles("vllm:inter_token_latency_seconds", by="pool")),
        ("Prompt + output tokens p50 / p95 / p99 (what --max-model-len bounds)", "short", [
            (f"p{round(q * 100)} {{{{route}}}} / {{{{pool}}}}",
             _quantile(q, "fleetgate_request_context_tokens", by="route, pool"))
            for q in (0.5, 0.95, 0.99)
        ]),
    ]),
    ("Replicas", [
        ("KV cache usage", "percentunit", [("{{pod}}", "max by (pod) (vllm:kv_cache_usage_perc)")]),
        ("Running / waiting requests", "short", [
            ("running {{pod}}", "sum by (pod) (vllm:num_requests_running)"),
            ("waiting {{pod}}", "sum by (pod) (vllm:num_requests_waiting)"),
        ]),
        ("Preemptions per second", "short", [
            ("{{pod}}", f"sum by (pod) (rate(vllm:num_preemptions_total[{RATE}]))"),
        ]),
        ("Engine prefix-cache hit rate", "percentunit", [
            ("{{pod}}", _ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                               by="pod")),
        ]),
        # With Redis every gateway reports the whole fleet's count per replica: max, not sum.
        ("In flight per replica (fleet view)", "short", [
            ("{{replica}}", "max by (replica) (fleetgate_replica_inflight)"),
        ]),
        # Each gateway pod's own requests (queued or upstream): what the gateway HPA scales on.
        ("In flight per gateway pod (HPA metric)", "short", [
            ("{{pod}}", "sum by (pod) (fleetgate_gateway_inflight_requests)"),
        ]),
        ("Retries on a fallback per second", "short", [
            ("{{reason}}", f"sum by (reason) (rate(fleetgate_upstream_retries_total[{RATE}]))"),
        ]),
        ("Gateway connections to engines", "short", [
            ("{{pod}}", "sum by (pod) (fleetgate_upstream_connections)"),
        ]),
    ]),
    ("Adapters", [
        ("LoRA slots in use", "short", [
            ("{{replica}}", "max by (replica) (fleetgate_adapter_slots_used)"),
        ]),
        ("Adapter loads per minute", "short", [
            ("{{outcome}}", "sum by (outcome) (rate(fleetgate_adapter_loads_total[5m])) * 60"),
        ]),
        ("Adapter cold-start p95", "s", [
            ("p95", "histogram_quantile(0.95, sum by (le) "
                    f"(rate(fleetgate_adapter_cold_start_seconds_bucket[{RATE}])))"),
        ]),
        ("Requests per adapter", "reqps", [
            ("{{adapter}}", f"sum by (adapter) (rate(fleetgate_adapter_requests_total[{RATE}]))"),
        ]),
    ]),
    ("Index health", [
        ("Index lookup p99", "s", [("{{backend}}", _quantile(0.99, "fleetgate_index_lookup_seconds",
                                                              by="backend"))]),
        ("Degraded (load-only) decisions per second", "short", [
            ("{{reason}}", f"sum by (reason) (rate(fleetgate_degraded_decisions_total[{RATE}]))"),
        ]),
        ("Agent event lag", "s", [
            ("{{replica}}", "max by (replica) (fleetgate_agent_event_lag_seconds)"),
        ]),
        ("Agent event gaps (15m)", "short", [
            ("{{replica}}", "sum by (replica) (increase(fleetgate_agent_event_gaps_total[15m]))"),
        ]),
    ]),
    # Flow control (docs/flow-control.md): what waits at the gateway and what it refuses.
    ("Flow control", [
        ("Gateway queue length by class", "short", [
            ("{{request_class}}", "sum by (request_class) (fleetgate_flow_queue_length)"),
        ]),
        ("Gateway queue wait p95 by class", "s", [
            ("{{request_class}}", _quantile(0.95, "fleetgate_flow_queue_wait_seconds",
                                            by="request_class")),
        ]),
        ("Admitted / queued / shed per second", "reqps", [
            ("{{decision}} {{request_class}}", "sum by (decision, request_class) "
                                              f"(rate(fleetgate_flow_decisions_total[{RATE}]))"),
        ]),
        ("Shed per second by reason and tenant", "reqps", [
            ("{{tenant}} {{reason}}", "sum by (tenant, reason) (rate(fleetgate_flow_decisions_total"
                                      f'{{decision="shed"}}[{RATE}]))'),
        ]),
        # Requests moved off a replica whose decodes ran too slow for them: critical ones
        # (flow_control.steer_critical; steady steering means routing's choices and the
        # engines' pace disagree), and others that would have waited on a calm fleet
        # (flow_control.steer_when_calm: bursts on a quiet fleet).
        ("Requests steered per second by class", "reqps", [
            ("{{tenant}} {{request_class}}",
             f"sum by (tenant, request_class) (rate(fleetgate_flow_steered_total[{RATE}]))"),
        ]),
        # Low (toward 0.5): requests have been missing their TPOT, so new work is held sooner;
        # high (toward 1.0): decodes keep pace and little is held (flow_control.tpot_target).
        ("Inter-token bound (fraction of the TPOT SLO)", "percentunit", [
            ("{{pod}}", "min by (pod) (fleetgate_flow_itl_bound_ratio)"),
        ]),
    ]),
]


def build() -> dict[str, Any]:
    """The dashboard as a Grafana JSON model (schemaVersion 39, a Prometheus datasource input)."""
    panels: list[dict[str, Any]] = []
    panel_id = 1
    y = 0
    for row_title, row_panels in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id += 1
        y += 1
        for index, (title, unit, targets) in enumerate(row_panels):
            panels.append({
                "id": panel_id,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "gridPos": {"h": 8, "w": 8, "x": (index % 3) * 8, "y": y + (index // 3) * 8},
                "targets": [
                    {"refId": chr(ord("A") + n), "expr": expr, "legendFormat": legend}
                    for n, (legend, expr) in enumerate(targets)
                ],
            })
            panel_id += 1
        y += ((len(row_panels) + 2) // 3) * 8
    return {
        "title": "fleetgate",
        "uid": "fleetgate-overview",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-3h", "to": "now"},
        "refresh": "30s",
        "tags": ["fleetgate", "vllm", "llm"],
        "templating": {"list": [{
            "name": "datasource", "type": "datasource", "query": "prometheus",
            "label": "Prometheus",
        }]},
        "panels": panels,
    }


def render() -> str:
    """The dashboard JSON text, exactly as committed."""
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
