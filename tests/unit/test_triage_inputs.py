"""Triage input files: one route or many, strict keys, errors that name the field."""

from __future__ import annotations

import json

import pytest

from planning.triage import MetricsError, RouteMetrics
from planning.triage.inputs import SINGLE_ROUTE, load_metrics_file, parse_metrics


def test_single_mapping_is_one_route() -> None:
    routes = parse_metrics({"ttft_p95_ms": 900, "ttft_slo_ms": 1000, "quality_headroom": True})
    assert routes == {
        SINGLE_ROUTE: RouteMetrics(ttft_p95_ms=900, ttft_slo_ms=1000, quality_headroom=True)
    }


def test_mapping_of_routes() -> None:
    routes = parse_metrics({"chat": {"kv_cache_usage": 0.5}, "rag": {"fine_tuned_variants": 2}})
    assert routes == {
        "chat": RouteMetrics(kv_cache_usage=0.5),
        "rag": RouteMetrics(fine_tuned_variants=2),
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "expected a non-empty mapping"),
        ({}, "expected a non-empty mapping"),
        ({"ttft_p95": 5}, "input.ttft_p95: unknown key"),
        ({"chat": {"kv_cache_usage": 94}}, r"input.chat.kv_cache_usage: must be in \[0, 1\]"),
        ({"ttft_slo_ms": 0}, "ttft_slo_ms: must be > 0"),
        ({"ttft_p95_ms": "fast"}, "ttft_p95_ms: must be a number"),
        ({"preemptions_per_min": -1}, "preemptions_per_min: must be >= 0"),
        ({"fine_tuned_variants": 2.5}, "fine_tuned_variants: must be an integer >= 0"),
        ({"quality_headroom": "yes"}, "quality_headroom: must be true or false"),
        ({"cache_busting_layout": 1}, "cache_busting_layout: must be true or false"),
        ({"utilisation": 1.5}, r"utilisation: must be in \[0, 1\]"),
        ({"chat": {"ttft_p95_ms": 1}, "ttft_slo_ms": 5}, "mixes route mappings"),
        ({"ttft_p95_ms": {"p": 1}}, "input.ttft_p95_ms: expected a metric value"),
    ],
)
def test_bad_input_names_the_field(data: object, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        parse_metrics(data)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_files_in_yaml_or_json(tmp_path, suffix: str) -> None:
    data = {"rag": {"ttft_p95_ms": 2400, "ttft_slo_ms": 1000, "shared_prefix_fraction": 0.7}}
    path = tmp_path / f"metrics{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        path.write_text(
            "rag:\n  ttft_p95_ms: 2400\n  ttft_slo_ms: 1000\n  shared_prefix_fraction: 0.7\n"
        )
    assert load_metrics_file(path) == {"rag": RouteMetrics(**data["rag"])}


def test_unreadable_and_malformed_files(tmp_path) -> None:
    with pytest.raises(MetricsError, match="cannot read"):
        load_metrics_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rag: [unclosed\n")
    with pytest.raises(MetricsError, match=r"bad\.yaml: not valid YAML or JSON"):
        load_metrics_file(bad)


def test_defaults_fill_only_unknown_values() -> None:
    own = RouteMetrics(ttft_p95_ms=900, ttft_slo_ms=500)
    merged = own.merged(RouteMetrics(ttft_slo_ms=2000, tpot_slo_ms=40, quality_headroom=True))
    assert merged == RouteMetrics(
        ttft_p95_ms=900, ttft_slo_ms=500, tpot_slo_ms=40, quality_headroom=True
    )


def test_files_read_exponent_numbers(tmp_path) -> None:
    path = tmp_path / "e.yaml"
    path.write_text("a:\n  ttft_p95_ms: 1e3\n  ttft_slo_ms: 8.5e2\n  waiting_mean: 2e0\n")
    routes = load_metrics_file(path)
    assert routes["a"] == RouteMetrics(ttft_p95_ms=1000, ttft_slo_ms=850, waiting_mean=2)
