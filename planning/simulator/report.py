"""Render a ``SimulationReport``: the text table, the ``--json`` list, the ``--plot`` PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from planning.simulator.api import SimulationReport
from planning.simulator.summary import PolicySummary

__all__ = ["render_json", "render_table", "write_plots"]

#: (header, attribute, format) of each table column.
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("hit rate", "prefix_hit_rate", "{:.1%}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("p95", "ttft_p95_ms", "{:.0f}"),
    ("p99", "ttft_p99_ms", "{:.0f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("p95", "tpot_p95_ms", "{:.1f}"),
    ("queue p95", "queue_p95_ms", "{:.0f}"),
    ("goodput", "goodput", "{:.1%}"),
    ("out tok/s", "output_tok_s", "{:,.0f}"),
    ("$/1M out", "cost_per_1m_usd", "{:.3f}"),
    ("imbalance", "load_imbalance", "{:.2f}"),
    ("preempt", "preemptions", "{}"),
)


def _cell(row: PolicySummary, attribute: str, fmt: str) -> str:
    value = getattr(row, attribute)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def render_table(report: SimulationReport, title: str = "") -> str:
    """A fixed-width table: one row per policy, then the two ceilings (hit rate only)."""
    rows = report.rows()
    cells = [[_cell(row, attr, fmt) for _, attr, fmt in _COLUMNS] for row in rows]
    headers = [header for header, _, _ in _COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(title)
    lines.append(
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    )
    for index, row_cells in enumerate(cells):
        if index == len(report.summaries):
            lines.append("ceilings (hit rate only):")
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row_cells, widths, strict=True))
            )
        )
    lines.append("TTFT, TPOT and queue times in ms; goodput = share meeting both SLOs.")
    return "\n".join(lines)


def render_json(report: SimulationReport) -> str:
    """The ``--json`` output: one object per policy, then the ``unbounded``/``pooled`` rows."""
    return json.dumps([row.as_json() for row in report.rows()], indent=2)


def write_plots(report: SimulationReport, directory: str | Path, prefix: str = "") -> list[Path]:
    """TTFT CDF per policy, and hit-rate and goodput bars; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, run in report.runs.items():
        ttft = np.sort([(o.first_token_s - o.arrival_s) * 1000.0 for o in run.outcomes])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    path = out / f"{prefix}ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, (hit_ax, good_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = report.rows()
    names = [row.policy for row in rows]
    colors = ["tab:blue"] * len(report.summaries) + ["tab:gray"] * (
        len(rows) - len(report.summaries)
    )
    hit_ax.bar(names, [row.prefix_hit_rate * 100 for row in rows], color=colors)
    hit_ax.set_ylabel("prefix hit rate (%)")
    hit_ax.set_title("Prefix hit rate (gray: ceilings)")
    summaries = report.summaries
    good_ax.bar([s.policy for s in summaries], [(s.goodput or 0.0) * 100 for s in summaries])
    good_ax.set_ylabel("goodput (% of requests within both SLOs)")
    good_ax.set_title("Goodput")
    for axis in (hit_ax, good_ax):
        axis.tick_params(axis="x", rotation=35)
        axis.set_ylim(0, 100)
    fig.tight_layout()
    path = out / f"{prefix}hit_rate_goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
