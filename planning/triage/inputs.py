"""Triage input from a YAML or JSON file: one route's metrics, or a mapping of route -> metrics."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from planning import yamlio
from planning.triage.model import FIELD_NAMES, MetricsError, RouteMetrics

#: Route name used when the input is a single mapping of metrics.
SINGLE_ROUTE = ""


def parse_metrics(data: Any, where: str = "input") -> dict[str, RouteMetrics]:
    """Route name -> metrics. A single mapping of metrics becomes the one route ``SINGLE_ROUTE``.

    A top level whose values are all mappings is read as routes; one that mixes metric keys and
    route mappings is refused, since either reading would silently drop data.
    """
    if not isinstance(data, Mapping) or not data:
        raise MetricsError(f"{where}: expected a non-empty mapping of metrics or of routes")
    nested = [key for key, value in data.items() if isinstance(value, Mapping)]
    if not nested:
        return {SINGLE_ROUTE: RouteMetrics.from_mapping(data, where)}
    if len(nested) != len(data):
        flat = sorted(str(key) for key in data if key not in nested)
        raise MetricsError(
            f"{where}: mixes route mappings ({', '.join(map(str, nested[:3]))}) with metric "
            f"values ({', '.join(flat[:3])}); use one metrics mapping or a mapping of routes"
        )
    clashes = sorted(str(key) for key in nested if key in FIELD_NAMES)
    if clashes:
        raise MetricsError(f"{where}.{clashes[0]}: expected a metric value, got a mapping")
    return {
        str(route): RouteMetrics.from_mapping(values, f"{where}.{route}")
        for route, values in data.items()
    }


def load_metrics_file(path: str | Path) -> dict[str, RouteMetrics]:
    """Read a YAML (or JSON, a subset of YAML) triage input file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MetricsError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        data = yamlio.load(text)
    except yaml.YAMLError as exc:
        raise MetricsError(f"{path}: not valid YAML or JSON ({exc})") from exc
    return parse_metrics(data, str(path))
