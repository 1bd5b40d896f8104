"""Render simulation results: the text table, the ``--json`` list, the ``--plot`` PNGs.

A single run renders from its ``SimulationReport``; a load sweep (several rate scales, maybe
several seeds per scale) from its ``SweepPoint`` list: JSON rows carry their ``rate_scale``, and
``write_load_plots`` draws each figure against load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from planning.simulator.api import SimulationReport, SweepPoint
from planning.simulator.summary import PolicySummary, Spread, default_policy

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "LoadCurve",
    "json_rows",
    "load_curves",
    "render_json",
    "render_table",
    "write_load_plots",
    "write_plots",
]

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


#: The request classes, in the order the flow-control table shows them.
_CLASSES = ("critical", "standard", "sheddable")


def _fixed_width(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> list[str]:
    """Header and rows, the first column left-aligned and the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    return [line(headers), *(line(row) for row in cells)]


def _flow_control_lines(report: SimulationReport) -> list[str]:
    """With request classes (``--classes``): goodput per class and what flow control did, one
    row per policy; nothing when every request was standard."""
    rows = [
        row
        for row in report.summaries
        if row.flow_control or set(row.goodput_by_class or {}) - {"standard"}
    ]
    if not rows:
        return []
    headers = ["policy", "flow control", *_CLASSES, "shed", "queued", "steered", "wait p95", "max"]
    cells = [
        [
            row.policy,
            ("on (no estimate)" if row.flow_control_blind else "on")
            if row.flow_control
            else "off",
            *(_class_goodput(row, name) for name in _CLASSES),
            str(row.shed),
            str(row.queued),
            str(row.steered),
            _cell(row, "gateway_wait_p95_ms", "{:.0f}"),
            _cell(row, "gateway_wait_max_ms", "{:.0f}"),
        ]
        for row in rows
    ]
    lines = [
        "goodput by class (refused requests count as misses) and flow control:",
        *_fixed_width(headers, cells),
        "wait: time in the gateway queue, in ms (docs/flow-control.md).",
    ]
    if any(row.flow_control_blind for row in rows):
        lines.append(
            "no estimate: the policy predicts no TTFT, which flow control judges by, so it "
            "admitted every request: the row is the policy without flow control."
        )
    return lines


def _class_goodput(row: PolicySummary, name: str) -> str:
    value = (row.goodput_by_class or {}).get(name)
    return "-" if value is None else f"{value:.1%}"


def render_table(report: SimulationReport, title: str = "") -> str:
    """A fixed-width table: one row per policy, then the two ceilings (hit rate only); with
    request classes, a second one of goodput by class and what flow control did."""
    cells = [[_cell(row, attr, fmt) for _, attr, fmt in _COLUMNS] for row in report.rows()]
    header, *body = _fixed_width([header for header, _, _ in _COLUMNS], cells)
    lines = [title] if title else []
    lines.append(header)
    for index, row_line in enumerate(body):
        if index == len(report.summaries):
            lines.append("ceilings (hit rate only):")
        lines.append(row_line)
    lines.append("TTFT, TPOT and queue times in ms; goodput = share meeting both SLOs.")
    lines.extend(_flow_control_lines(report))
    default = default_policy()
    if any(row.policy == default for row in report.summaries):
        lines.append(f"default policy (fleetgate serve / up): {default}")
    return "\n".join(lines)


def json_rows(report: SimulationReport, rate_scale: float) -> list[dict[str, object]]:
    """One JSON object per policy, then the ceilings, each with exactly ``JSON_FIELDS``.

    ``default`` is true on the row of the policy the gateway uses when a route names none, and
    false on every other row (the ceilings included).
    """
    default = default_policy()
    rows = []
    for row in report.rows():
        fields = row.as_json()
        del fields["policy"]
        rows.append(
            {"policy": row.policy, "rate_scale": rate_scale, "default": row.policy == default}
            | fields
        )
    return rows


def render_json(points: Sequence[SweepPoint]) -> str:
    """The ``--json`` output: each point's policy rows and ceiling rows, points in order."""
    return json.dumps([row for p in points for row in json_rows(p.report, p.rate_scale)], indent=2)


def write_plots(
    report: SimulationReport, directory: str | Path, prefix: str = "", title: str = ""
) -> list[Path]:
    """TTFT CDF per policy, and hit-rate and goodput bars; returns the files written.
    ``title`` (the trace, the load) heads every figure: the files of a sweep look alike."""
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
    ax.set_title(f"TTFT CDF per policy{': ' + title if title else ''}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    path = out / f"{prefix}ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, (hit_ax, good_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    if title:
        fig.suptitle(title)
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


# --------------------------------------------------------------------------- load sweeps


@dataclass(frozen=True)
class LoadCurve:
    """One policy's figure against load: a spread over seeds at each rate scale, scales sorted."""

    policy: str
    scales: tuple[float, ...]
    values: tuple[Spread, ...]


def load_curves(points: Sequence[SweepPoint], attribute: str) -> list[LoadCurve]:
    """Per policy (first-seen order), ``PolicySummary.<attribute>`` at each scale, over seeds.

    The ceilings are curves too, named ``unbounded`` and ``pooled`` (hit rate only).
    """
    by_policy: dict[str, dict[float, list[float | None]]] = {}
    for point in points:
        for row in point.report.rows():
            values = by_policy.setdefault(row.policy, {}).setdefault(point.rate_scale, [])
            values.append(getattr(row, attribute))
    return [
        LoadCurve(
            policy,
            tuple(sorted(per_scale)),
            tuple(Spread.of(per_scale[x]) for x in sorted(per_scale)),
        )
        for policy, per_scale in by_policy.items()
    ]


@dataclass(frozen=True)
class _LoadPlot:
    """One figure drawn against load by ``write_load_plots``."""

    stem: str
    #: The ``PolicySummary`` attribute plotted.
    attribute: str
    y_label: str
    #: From the attribute's unit to the plotted one (shares to percent).
    factor: float = 1.0
    log_y: bool = False
    #: Fixed y range (goodput: the whole 0-100% so that the knee shows as a drop).
    y_range: tuple[float, float] | None = None


_LOAD_PLOTS = (
    _LoadPlot(
        "goodput_vs_load",
        "goodput",
        "goodput (% of requests within both SLOs)",
        100.0,
        y_range=(0.0, 102.0),
    ),
    _LoadPlot("ttft_p95_vs_load", "ttft_p95_ms", "p95 TTFT (ms, log scale)", log_y=True),
    _LoadPlot("hit_rate_vs_load", "prefix_hit_rate", "prefix hit rate (%)", 100.0),
)

_CEILINGS = ("unbounded", "pooled")


def write_load_plots(
    points: Sequence[SweepPoint],
    directory: str | Path,
    prefix: str = "",
    *,
    title: str = "",
    x_label: str = "rate scale (x the trace's request rate)",
    slo_ttft_ms: float | None = None,
) -> list[Path]:
    """Goodput, p95 TTFT and hit rate against rate scale: one line per policy, default in bold.

    Where a scale has several seeds, the line goes through their mean and a bar spans min–max.
    The hit-rate plot adds the pooled ceiling (dashed); the TTFT plot the TTFT SLO, if given.
    Files: ``<prefix>goodput_vs_load.png``, ``…ttft_p95_vs_load.png``, ``…hit_rate_vs_load.png``.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    default = default_policy()
    scales = sorted({p.rate_scale for p in points})
    written = []
    for plot in _LOAD_PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for curve in load_curves(points, plot.attribute):
            if curve.policy == "pooled" and plot.attribute == "prefix_hit_rate":
                _draw_curve(ax, curve, plot.factor, "pooled ceiling", "gray", "--", marker=None)
            elif curve.policy not in _CEILINGS:
                _draw_policy(ax, curve, plot.factor, curve.policy == default)
        if slo_ttft_ms is not None and plot.attribute == "ttft_p95_ms":
            ax.axhline(slo_ttft_ms, color="gray", linestyle=":", label="TTFT SLO")
        if plot.log_y:
            _log_axis_in_plain_numbers(ax)
        if plot.y_range is not None:
            ax.set_ylim(*plot.y_range)
        ax.set_xticks(scales, [f"{x:g}×" for x in scales])
        ax.set_xlabel(x_label)
        ax.set_ylabel(plot.y_label)
        heading = plot.y_label.split(" (")[0] + " vs load"
        ax.set_title(f"{title}: {heading}" if title else heading)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        path = out / f"{prefix}{plot.stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _log_axis_in_plain_numbers(ax: Axes) -> None:
    # An SRE reads "500 ms", not "5 x 10^2": label 1-2-5 steps as plain numbers.
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _draw_policy(ax: Axes, curve: LoadCurve, factor: float, is_default: bool) -> None:
    # The default policy is the one an SRE gets without choosing: it must stand out, on top.
    if is_default:
        _draw_curve(
            ax, curve, factor, f"{curve.policy} (default)", "black", "-", width=2.6, zorder=4
        )
    else:
        _draw_curve(ax, curve, factor, curve.policy, None, "-", width=1.2)


def _draw_curve(
    ax: Axes,
    curve: LoadCurve,
    factor: float,
    label: str,
    color: str | None,
    style: str,
    width: float = 1.2,
    marker: str | None = "o",
    zorder: float = 2,
) -> None:
    means = np.array([v.mean for v in curve.values]) * factor
    low = np.array([v.low for v in curve.values]) * factor
    high = np.array([v.high for v in curve.values]) * factor
    (line,) = ax.plot(
        curve.scales,
        means,
        style,
        marker=marker,
        label=label,
        color=color,
        linewidth=width,
        zorder=zorder,
    )
    if any(v.count > 1 for v in curve.values):
        ax.errorbar(
            curve.scales,
            means,
            # Clipped: the mean of equal values can land an ulp outside them (0.1 * 3 / 3).
            yerr=np.clip(np.vstack([means - low, high - means]), 0.0, None),
            fmt="none",
            ecolor=line.get_color(),
            capsize=3,
            linewidth=width * 0.8,
            zorder=zorder,
        )
