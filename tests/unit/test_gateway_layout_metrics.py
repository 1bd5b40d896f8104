"""Prefix-layout diagnostics, and the metrics contract with docs/metrics.md."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from gateway.index_metrics import MirrorCollector
from gateway.layout import LayoutDiagnostics
from gateway.metrics import GatewayMetrics
from replica.agent.metrics import AgentMetrics
from routing.contracts import TokenizedPrompt
from routing.hashing import chain_seed, prompt_chain
from routing.index.mirror import MirrorBlockIndex

SEED = chain_seed("m")
SHARED = [1000 + i for i in range(64)]  # 4 blocks of 16 shared tokens


def _observe(layout: LayoutDiagnostics, tokens: list[int]) -> None:
    prompt = TokenizedPrompt(token_ids=tokens)
    layout.observe("r", prompt, prompt_chain(prompt, 16, SEED), 16)


def test_unique_prefix_before_shared_content_is_cache_busting() -> None:
    layout = LayoutDiagnostics(min_requests=5)
    for i in range(5):
        _observe(layout, [i] * 16 + SHARED)  # a unique first block, then the shared blocks
    (report,) = layout.reports()
    assert report.cache_busting_layout
    assert report.prefix_repeat_fraction == 0.0
    # 4 of 5 blocks repeat by content from the second request on: 16 / 25 overall.
    assert report.content_repeat_after_miss_fraction == 16 / 25
    assert report.median_first_miss_block == 0


def test_shared_prefix_first_is_healthy() -> None:
    layout = LayoutDiagnostics(min_requests=5)
    for i in range(5):
        _observe(layout, [*SHARED, *([i] * 16)])
    (report,) = layout.reports()
    assert not report.cache_busting_layout
    assert report.prefix_repeat_fraction == 16 / 25


def test_detection_waits_for_enough_requests() -> None:
    layout = LayoutDiagnostics(min_requests=10)
    for i in range(5):
        _observe(layout, [i] * 16 + SHARED)
    assert not layout.reports()[0].cache_busting_layout


def _documented_metrics(heading: str = "## Gateway") -> set[str]:
    text = Path(__file__).resolve().parents[2].joinpath("docs/metrics.md").read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(fleetgate_[a-z0-9_]+)`", section, flags=re.M))


def _documented_gateway_metrics() -> set[str]:
    return _documented_metrics("## Gateway")


def _exported(registry: CollectorRegistry) -> set[str]:
    return {
        family.name + ("_total" if family.type == "counter" else "")
        for family in registry.collect()
    }


def test_every_documented_gateway_metric_is_exported_and_nothing_else() -> None:
    assert _exported(GatewayMetrics().registry) == _documented_gateway_metrics()


def test_the_index_mirror_and_agent_metrics_are_documented() -> None:
    mirror = CollectorRegistry()
    mirror.register(MirrorCollector(MirrorBlockIndex("redis://127.0.0.1:1/0")))  # never connects
    assert _exported(mirror) == _documented_metrics("## Index mirror")
    assert _exported(AgentMetrics("r0").registry) == _documented_metrics("## Replica agent")


def test_no_created_series() -> None:
    """Counters and histograms export no ``*_created`` samples (docs/metrics.md)."""
    metrics = GatewayMetrics()
    metrics.requests.labels("r", "m", "x", "200").inc()
    metrics.ttft.labels("r", "m").observe(0.1)
    text = generate_latest(metrics.registry).decode()
    assert "fleetgate_requests_total{" in text
    assert "_created" not in text
