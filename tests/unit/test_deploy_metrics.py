"""Every metric the Grafana dashboard and the alert rules query is one that something exports.

fleetgate's own metrics are collected from the real registries of the gateway, the adapter
registry and the replica agent (not from a list in this test); vLLM's are the names DESIGN.md
fixes, which the e2e tier checks against a real engine (tests/e2e/test_sim_matches_vllm.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from adapters_registry.metrics import AdapterMetrics
from gateway.index_metrics import MirrorCollector
from gateway.metrics import GatewayMetrics
from replica.agent.metrics import AgentMetrics
from routing.index.mirror import MirrorBlockIndex

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "fleetgate-dashboard.json"
RULES = REPO / "deploy" / "base" / "prometheus-rules.yaml"

#: vLLM's metric names as DESIGN.md lists them (what engines export, without sample suffixes).
VLLM_METRICS = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
}
_METRIC = re.compile(r"\b((?:fleetgate_|vllm:)[a-zA-Z0-9_:]+)")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def _family(sample_name: str) -> str:
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def exported_families() -> set[str]:
    """Metric families registered by the gateway (its index mirror's too), the adapter registry
    and the agent."""
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    AdapterMetrics(registry)
    AgentMetrics("r0", registry)
    # The gateway's index mirror (index.mode: mirror); never connects here.
    registry.register(MirrorCollector(MirrorBlockIndex("redis://127.0.0.1:1/0")))
    return {metric.name for metric in registry.collect()} | VLLM_METRICS


def queried_metrics() -> dict[str, set[str]]:
    """Metric family -> where it is queried (dashboard panel or alert name)."""
    used: dict[str, set[str]] = {}
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in _METRIC.findall(target["expr"]):
                used.setdefault(_family(name), set()).add(f"panel {panel['title']!r}")
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["spec"]["groups"]:
        for rule in group["rules"]:
            for name in _METRIC.findall(rule["expr"]):
                used.setdefault(_family(name), set()).add(f"alert {rule.get('alert')}")
    return used


def test_dashboard_and_alerts_query_only_exported_metrics() -> None:
    exported = exported_families()
    used = queried_metrics()
    assert len(used) > 20  # the extraction found the queries
    missing = {name: sorted(where) for name, where in used.items() if name not in exported}
    assert not missing, f"queried but exported by nothing: {missing}"


def test_committed_dashboard_is_what_the_generator_builds() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build_dashboard", REPO / "deploy" / "grafana" / "build_dashboard.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), (
        "deploy/grafana/fleetgate-dashboard.json is stale: run "
        "python deploy/grafana/build_dashboard.py"
    )
