"""Prefix-layout diagnostics, and the metrics contract with docs/metrics.md."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.layout import LayoutDiagnostics
from gateway.metrics import GatewayMetrics
from routing.contracts import TokenizedPrompt
from routing.hashing import chain_seed, prompt_chain

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


def _documented_gateway_metrics() -> set[str]:
    text = Path(__file__).resolve().parents[2].joinpath("docs/metrics.md").read_text()
    section = text.split("## Gateway", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(fleetgate_[a-z0-9_]+)`", section, flags=re.M))


def test_every_documented_gateway_metric_is_exported_and_nothing_else() -> None:
    registry = GatewayMetrics().registry
    exported = set()
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        exported.add(name)
    assert exported == _documented_gateway_metrics()
