"""Print triage results: a readable report per route, or JSON for scripts."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence

from planning.triage.decide import unchecked
from planning.triage.inputs import SINGLE_ROUTE
from planning.triage.model import Lever, RouteMetrics


def to_json(results: Mapping[str, Sequence[Lever]]) -> str:
    """A list of ``{"lever", "reason"}`` for single-route input, else route -> that list."""
    if set(results) == {SINGLE_ROUTE}:
        return json.dumps([lever.to_dict() for lever in results[SINGLE_ROUTE]], indent=2)
    payload = {route: [lever.to_dict() for lever in levers] for route, levers in results.items()}
    return json.dumps(payload, indent=2)


def describe(metrics: RouteMetrics) -> str:
    """The signals triage saw, on one line; unknown ones are left out."""
    parts = []
    if metrics.ttft_p95_ms is not None:
        slo = f" (SLO {metrics.ttft_slo_ms:,g})" if metrics.ttft_slo_ms is not None else ""
        parts.append(f"TTFT p95 {metrics.ttft_p95_ms:,.0f} ms{slo}")
    if metrics.tpot_p95_ms is not None:
        slo = f" (SLO {metrics.tpot_slo_ms:,g})" if metrics.tpot_slo_ms is not None else ""
        parts.append(f"TPOT p95 {metrics.tpot_p95_ms:.1f} ms{slo}")
    if metrics.shared_prefix_fraction is not None:
        parts.append(f"shared prefix {metrics.shared_prefix_fraction:.0%}")
    if metrics.kv_cache_usage is not None:
        parts.append(f"KV {metrics.kv_cache_usage:.0%}")
    if metrics.preemptions_per_min is not None:
        parts.append(f"{metrics.preemptions_per_min:.1f} preemptions/min")
    if metrics.waiting_mean is not None:
        parts.append(f"{metrics.waiting_mean:.1f} waiting")
    if metrics.waiting_growth_per_min is not None:
        parts.append(f"queue {metrics.waiting_growth_per_min:+.1f}/min")
    if metrics.fine_tuned_variants is not None:
        parts.append(f"fine-tuned variants {metrics.fine_tuned_variants}")
    for name, missed in (("TTFT", metrics.ttft_slo_missed), ("TPOT", metrics.tpot_slo_missed)):
        if missed is not None:
            parts.append(f"{missed:.1%} missed the {name} SLO")
    if metrics.utilisation is not None:
        parts.append(f"replicas busy {metrics.utilisation:.0%}")
    if metrics.shed_share is not None:
        parts.append(f"flow control refused {metrics.shed_share:.1%}")
    if metrics.cache_busting_layout:
        parts.append("CACHE-BUSTING LAYOUT")
    return ", ".join(parts) or "no signals"


def to_text(
    metrics: Mapping[str, RouteMetrics], results: Mapping[str, Sequence[Lever]], width: int = 100
) -> str:
    """Numbered levers per route, each with its reason, and the rules that could not run."""
    blocks = []
    for route, levers in results.items():
        title = f"route {route}" if route != SINGLE_ROUTE else "input"
        lines = [textwrap.fill(f"{title}: {describe(metrics[route])}", width=width)]
        for number, lever in enumerate(levers, start=1):
            lines.append(f"  {number}. [{lever.category}] {lever.action}")
            lines.append(
                textwrap.fill(
                    lever.why, width=width, initial_indent="       ", subsequent_indent="       "
                )
            )
        missing = unchecked(metrics[route])
        if missing:
            lines.append(
                textwrap.fill(
                    f"not checked (unknown inputs): {'; '.join(missing)}",
                    width=width,
                    initial_indent="  ",
                    subsequent_indent="    ",
                )
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
