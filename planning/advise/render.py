"""Print advice: per pool, what was seen, then every flag with its value, source and evidence."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from planning.advise.model import TIMERS, Advice, Percentiles, PoolSnapshot


def to_json(pools: Mapping[str, PoolSnapshot], results: Mapping[str, Sequence[Advice]]) -> str:
    """``{pool: {"replicas", "hardware", "model", "advice": [row, ...]}}``."""
    payload = {
        name: {
            "replicas": pools[name].replicas,
            "hardware": pools[name].hardware,
            "model": pools[name].model,
            "advice": [row.to_dict() for row in rows],
        }
        for name, rows in results.items()
    }
    return json.dumps(payload, indent=2)


def value(v: Any) -> str:
    """A flag value as you would type it."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, int) and v >= 10_000:
        return f"{v:,}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def describe(pool: PoolSnapshot) -> str:
    """One line of what the pool served and how its engines behaved."""
    m = pool.measured
    what = f"{pool.replicas} replica{'s' if pool.replicas != 1 else ''}"
    if pool.model and pool.hardware:
        what += f", {pool.model} on {pool.hardware}"
    parts = []
    if m.requests is not None:
        parts.append(f"{m.requests:,} requests")
    if m.context_p99 is not None:
        parts.append(f"p99 prompt+output {m.context_p99:,.0f} tokens")
    if m.kv_usage is not None:
        parts.append(f"KV {m.kv_usage:.0%}")
    if m.waiting_mean is not None:
        parts.append(f"{m.waiting_mean:.1f} waiting")
    if m.preemptions_per_min is not None:
        parts.append(f"{m.preemptions_per_min:g} preemptions/min")
    if m.prefix_hit_rate is not None:
        parts.append(f"prefix hit {m.prefix_hit_rate:.0%}")
    if m.window_s:
        parts.append(f"watched {m.window_s:.0f} s")
    return f"pool {pool.pool} ({what}): " + ("; ".join(parts) or "no measurements")


def timer_table(pool: PoolSnapshot) -> list[str]:
    """The four timers at p50/p95/p99, if any is known."""
    timers = pool.measured.timers
    if not timers:
        return []
    lines = [f"  {'timer (ms)':<12}{'p50':>8}{'p95':>8}{'p99':>8}"]
    bounded = False
    for name in TIMERS:
        p = timers.get(name) or Percentiles()
        row = f"  {name:<12}"
        for field in ("p50_ms", "p95_ms", "p99_ms"):
            cell = getattr(p, field)
            text = "-" if cell is None else f"{cell:.0f}"
            if cell is not None and field in p.at_most:
                text, bounded = f"<={text}", True
            row += f"{text:>8}"
        lines.append(row)
    if bounded:
        lines.append("  (<=N: in the histogram's first bucket, 0 to N ms; it says no more)")
    return lines


def to_text(
    pools: Mapping[str, PoolSnapshot],
    results: Mapping[str, Sequence[Advice]],
    width: int = 100,
    only_changes: bool = False,
) -> str:
    """Readable advice for every pool."""
    blocks = []
    indent = " " * 6
    for name, rows in results.items():
        pool = pools[name]
        lines = [textwrap.fill(describe(pool), width=width, subsequent_indent="  ")]
        lines += timer_table(pool)
        for row in rows:
            if only_changes and row.kind != "change":
                continue
            now = f"{row.flag} {value(row.current)} [{row.current_source}]"
            if row.kind == "change":
                lines.append(f"  {now} -> {value(row.advised)}")
            else:
                lines.append(f"  {now}: {row.kind}")
            lines.append(
                textwrap.fill(row.evidence, width, initial_indent=indent, subsequent_indent=indent)
            )
            if row.effect:
                lines.append(
                    textwrap.fill(
                        f"effect: {row.effect}",
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        if not any(row.kind == "change" for row in rows):
            lines.append("  no change: every flag checked fits what this pool serves")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
