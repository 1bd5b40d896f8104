"""Percentiles and totals of a replay, as a table or a JSON object."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from bench.replay.runner import ReplayResult
from bench.replay.server_metrics import CacheCounters
from routing.redis_clients import redacted

__all__ = ["render_table", "summarize"]


def _pct(values: Sequence[float], q: float, scale: float = 1000.0) -> float | None:
    return float(np.percentile(np.asarray(values), q)) * scale if values else None


def summarize(
    result: ReplayResult, run: Mapping[str, object] | None = None
) -> dict[str, object]:
    """The replay's figures; times in ms, ``None`` where nothing was measured. ``run``: what was
    replayed and how (trace, URL, settings), kept in the summary so a saved one says."""
    ok = [r for r in result.results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    lag = [r.start_lag_s for r in result.results]
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    all_prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok if r.cached_tokens is not None)
    cached_tokens = sum(r.cached_tokens or 0 for r in ok if r.cached_tokens is not None)
    errors: dict[str, int] = {}
    for r in result.results:
        if not r.ok:
            error = r.error or "unknown"
            key = error if len(error) <= 200 else error[:200] + "…"
            errors[key] = errors.get(key, 0) + 1
    server: dict[str, object] = {}
    queries = hits = 0.0
    for raw_url, delta in result.server_cache.items():
        url = redacted(raw_url)  # printed and saved: no password
        if isinstance(delta, CacheCounters):
            server[url] = {
                "prefix_cache_queries": delta.queries,
                "prefix_cache_hits": delta.hits,
                "hit_rate": delta.hits / delta.queries if delta.queries else None,
            }
            queries += delta.queries
            hits += delta.hits
        else:
            server[url] = {"error": delta}
    wall = result.wall_s
    lag_p95 = _pct(lag, 95)
    warnings = []
    if lag_p95 is not None and lag_p95 >= LAG_WARN_MS:
        warnings.append(
            f"client start lag p95 {lag_p95:.0f} ms: the client or --concurrency cannot keep "
            "the trace's pace, so the load was lighter than the trace's and latencies "
            "understate its queueing (raise --concurrency)"
        )
    zero_gaps = sum(gap < ZERO_GAP_S for gap in itl)
    if len(itl) >= ZERO_GAP_MIN_SAMPLES and zero_gaps / len(itl) >= ZERO_GAP_WARN_SHARE:
        warnings.append(
            "many inter-token gaps read 0 (chunks arrived in one read: the client fell "
            "behind): read TPOT rather than ITL"
        )
    for url, delta in result.server_cache.items():
        if isinstance(delta, CacheCounters) and delta.queries == 0 and ok:
            warnings.append(
                f"{redacted(url)} counted no prefix-cache queries: is it a vLLM engine's /metrics "
                "(vllm:prefix_cache_queries_total)?"
            )
    summary: dict[str, object] = {}
    if run:
        summary["run"] = dict(run)
    if result.interrupted:
        summary["interrupted"] = result.interrupted
        summary["planned"] = result.planned
    summary.update({
        "requests": len(result.results),
        "ok": len(ok),
        "errors": errors,
        "warnings": warnings,
        "wall_s": wall,
        "request_rate": len(ok) / wall if wall > 0 else None,
        "output_tokens": output_tokens,
        "prompt_tokens": all_prompt_tokens,
        "output_tok_s": output_tokens / wall if wall > 0 else None,
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p95_ms": _pct(ttft, 95),
        "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_p95_ms": _pct(tpot, 95),
        "tpot_p99_ms": _pct(tpot, 99),
        "itl_p50_ms": _pct(itl, 50),
        "itl_p95_ms": _pct(itl, 95),
        "itl_p99_ms": _pct(itl, 99),
        "e2e_p50_ms": _pct(e2e, 50),
        "e2e_p95_ms": _pct(e2e, 95),
        "start_lag_p95_ms": lag_p95,
        # From usage.prompt_tokens_details.cached_tokens, when the server reports it.
        "client_cached_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
        "server_prefix_hit_rate": hits / queries if queries else None,
        "server_prefix_cache": server,
    })
    return summary


def _fmt(value: object, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def render_table(summary: dict[str, object]) -> str:
    """A short human-readable report."""
    s = summary
    lines = []
    if s.get("interrupted"):
        lines.append(
            f"INTERRUPTED by {s['interrupted']}: {s['requests']} of {s['planned']} requests "
            "finished; the figures are theirs"
        )
    lines += [
        f"requests {s['requests']}  ok {s['ok']}  in {_fmt(s['wall_s'], '{:.1f}')} s  "
        f"({_fmt(s['request_rate'], '{:.2f}')} req/s, "
        f"{_fmt(s['output_tok_s'], '{:,.0f}')} output tok/s)",
        f"TTFT ms  p50 {_fmt(s['ttft_p50_ms'], '{:.0f}')}  p95 {_fmt(s['ttft_p95_ms'], '{:.0f}')}"
        f"  p99 {_fmt(s['ttft_p99_ms'], '{:.0f}')}",
        f"TPOT ms  p50 {_fmt(s['tpot_p50_ms'], '{:.1f}')}  p95 {_fmt(s['tpot_p95_ms'], '{:.1f}')}"
        f"  p99 {_fmt(s['tpot_p99_ms'], '{:.1f}')}",
        f"ITL ms   p50 {_fmt(s['itl_p50_ms'], '{:.1f}')}  p95 {_fmt(s['itl_p95_ms'], '{:.1f}')}"
        f"  p99 {_fmt(s['itl_p99_ms'], '{:.1f}')}",
        f"E2E ms   p50 {_fmt(s['e2e_p50_ms'], '{:.0f}')}  p95 {_fmt(s['e2e_p95_ms'], '{:.0f}')}",
        f"client start lag p95 {_fmt(s['start_lag_p95_ms'], '{:.0f}')} ms",
        f"cached tokens reported in responses: {_fmt(s['client_cached_rate'], '{:.1%}')}",
        f"server prefix-cache hit rate (metrics deltas): "
        f"{_fmt(s['server_prefix_hit_rate'], '{:.1%}')}",
    ]
    server = s["server_prefix_cache"]
    assert isinstance(server, dict)
    for url, figures in server.items():
        lines.append(f"  {url}: {json.dumps(figures)}")
    errors = s["errors"]
    assert isinstance(errors, dict)
    for message, count in errors.items():
        lines.append(f"error x{count}: {message}")
    warnings = s["warnings"]
    assert isinstance(warnings, list)
    lines += [f"warning: {warning}" for warning in warnings]
    return "\n".join(lines)


#: A p95 start lag from which the replay no longer keeps the trace's pace (requests start later
#: than their timestamps say, so the load measured is lighter than the trace's).
LAG_WARN_MS = 100.0
#: An inter-token gap under this reads as 0: chunks that arrived in one socket read.
ZERO_GAP_S = 0.0002
#: The share of such gaps from which ITL percentiles say more about the client than the server.
ZERO_GAP_WARN_SHARE = 0.2
#: ... judged on at least this many gaps.
ZERO_GAP_MIN_SAMPLES = 50
