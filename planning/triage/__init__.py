"""Symptom-to-lever triage: which serving levers to pull for each route, in what order.

``triage(RouteMetrics) -> list[Lever]`` is pure; ``sources`` read metrics from a file, a running
gateway or Prometheus; ``render`` prints the answer. ``fleetgate triage`` wires them together.
"""

from __future__ import annotations

from planning.triage.decide import triage, unchecked
from planning.triage.model import CATEGORIES, Lever, LeverCategory, MetricsError, RouteMetrics

__all__ = [
    "CATEGORIES",
    "Lever",
    "LeverCategory",
    "MetricsError",
    "RouteMetrics",
    "triage",
    "unchecked",
]
