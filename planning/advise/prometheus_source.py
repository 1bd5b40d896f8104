"""``advise --prometheus URL``: the same measurements as the live reader, as PromQL over a window.

Engine series are grouped by ``pool_label`` (default ``pool``: relabel the engines' pod label
``fleetgate.io/pool`` to it in the scrape config); series without it form the pool ``default``.
The gateway's length histograms (``fleetgate_request_budget_tokens`` too) carry ``pool``
themselves. Adapter requests and loads have no pool label: they are attributed only when there is
one pool. ``--max-model-len`` is not in
Prometheus (``/v1/models`` has it): give it with ``--flags``, or the row says "not checked".
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import httpx

from planning.advise.engine_metrics import ENGINE_TIMERS, EngineReading, flags_of
from planning.advise.model import Measurements, Percentiles, PoolSnapshot
from planning.triage.model import SourceError
from planning.triage.prometheus_source import query

_LENGTH = "fleetgate_request_{kind}_tokens"
_BUDGET = "fleetgate_request_budget_tokens"


def _seconds(window: str) -> float:
    """A PromQL duration (``10m``, ``1h30m``, ``90s``) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", window)
    if not parts or "".join(n + u for n, u in parts) != window:
        raise SourceError(f"--window {window!r}: not a PromQL duration (e.g. 10m)")
    return sum(int(n) * units[u] for n, u in parts)


def _overflow(name: str, w: str) -> str:
    """PromQL: observations of histogram ``name`` above its top finite bucket, per pool.

    ``histogram_quantile(1, ...)`` answers the top finite bound when the longest observation is
    in ``+Inf``, which understates it; this tells the two apart whatever the buckets are (the
    cumulative count of the top finite bucket is the largest finite one).
    """
    return (
        f'sum by (pool) (increase({name}_bucket{{le="+Inf"}}[{w}])) - max by (pool) '
        f'(sum by (pool, le) (increase({name}_bucket{{le!="+Inf"}}[{w}])))'
    )


def _queries(w: str, by: str) -> dict[str, str]:
    """Measurement field -> PromQL, per pool."""
    out = {}
    for kind in ("prompt", "output", "context"):
        name = _LENGTH.format(kind=kind)
        out[f"{kind}_p99"] = (
            f"histogram_quantile(0.99, sum by (pool, le) (increase({name}_bucket[{w}])))"
        )
        out[f"{kind}_max"] = (
            f"histogram_quantile(1, sum by (pool, le) (increase({name}_bucket[{w}])))"
        )
        out[f"{kind}_overflow"] = _overflow(name, w)
        out[f"{kind}_mean"] = (
            f"sum by (pool) (increase({name}_sum[{w}])) / "
            f"sum by (pool) (increase({name}_count[{w}]))"
        )
    out["requests"] = f"sum by (pool) (increase({_LENGTH.format(kind='context')}_count[{w}]))"
    # The longest prompt + requested output budget: the top non-empty bucket's upper bound
    # (unknown when some budget is above the top bucket).
    out["requested_context_max"] = (
        f"histogram_quantile(1, sum by (pool, le) (increase({_BUDGET}_bucket[{w}])))"
    )
    out["requested_overflow"] = _overflow(_BUDGET, w)
    out |= {
        "kv_usage": f"max by ({by}) (avg_over_time(vllm:kv_cache_usage_perc[{w}]))",
        "waiting_mean": f"avg by ({by}) (avg_over_time(vllm:num_requests_waiting[{w}]))",
        "waiting_growth_per_min": f"60 * avg by ({by}) (deriv(vllm:num_requests_waiting[{w}]))",
        "preemptions_per_min": f"60 * sum by ({by}) (rate(vllm:num_preemptions_total[{w}]))",
        "running_peak": f"max by ({by}) (max_over_time(vllm:num_requests_running[{w}]))",
        # The lowest running level of a replica in a minute in which it preempted.
        "running_at_preemption": (
            f"min by ({by}) (min_over_time((vllm:num_requests_running and "
            f"increase(vllm:num_preemptions_total[1m]) > 0)[{w}:15s]))"
        ),
        "prefix_hit_rate": (
            f"sum by ({by}) (rate(vllm:prefix_cache_hits_total[{w}])) / "
            f"sum by ({by}) (rate(vllm:prefix_cache_queries_total[{w}]))"
        ),
        "replicas": f"count by ({by}) (vllm:cache_config_info)",
        "request_rate_per_s": (
            f"sum by ({by}) (rate(vllm:time_to_first_token_seconds_count[{w}]))"
        ),
    }
    for name, family in ENGINE_TIMERS.items():
        for q in (50, 95, 99):
            out[f"timer:{name}:{q}"] = (
                f"1000 * histogram_quantile(0.{q}, sum by ({by}, le) (rate({family}_bucket[{w}])))"
            )
    return out


#: Fleet-wide adapter figures (no pool label on them).
def _adapter_queries(w: str) -> dict[str, str]:
    return {
        "adapter_working_set": f"count(increase(fleetgate_adapter_requests_total[{w}]) > 0)",
        "adapter_loads_per_min": f"60 * sum(rate(fleetgate_adapter_loads_total[{w}]))",
        "adapter_unloads_per_min": f"60 * sum(rate(fleetgate_adapter_unloads_total[{w}]))",
    }


def fetch_prometheus_pools(
    base_url: str, client: httpx.Client, window: str = "10m", pool_label: str = "pool"
) -> dict[str, PoolSnapshot]:
    """Pool name -> snapshot over the last ``window``."""
    seconds = _seconds(window)
    values: dict[str, dict[str, float]] = defaultdict(dict)
    for field, promql in _queries(window, pool_label).items():
        label = (
            "pool"
            if field.split("_")[0] in ("prompt", "output", "context", "requests", "requested")
            else (pool_label)
        )
        for labels, value in query(client, base_url, promql):
            values[labels.get(label) or "default"][field] = value
    infos: dict[str, EngineReading] = {}
    for labels, _value in query(client, base_url, "vllm:cache_config_info"):
        infos.setdefault(labels.get(pool_label) or "default", EngineReading(cache_info=labels))
    for labels, _value in query(
        client, base_url, f"max by ({pool_label}, max_lora) (vllm:lora_requests_info)"
    ):
        reading = infos.setdefault(labels.get(pool_label) or "default", EngineReading())
        reading.max_lora = int(labels["max_lora"]) if labels.get("max_lora") else None
    pools = sorted(set(infos) | {p for p, v in values.items() if "replicas" in v})
    if len(pools) == 1:
        for field, promql in _adapter_queries(window).items():
            results = query(client, base_url, promql)
            if results:
                values[pools[0]][field] = results[0][1]
    return {
        pool: PoolSnapshot(
            pool=pool,
            flags=flags_of(infos.get(pool, EngineReading()), None),
            measured=_measurements(values[pool], seconds),
            replicas=int(values[pool].get("replicas", 1)),
        )
        for pool in pools
    }


#: Above this many observations in ``+Inf`` (``increase`` extrapolates, so not exactly 0 or 1),
#: a histogram's longest is past its top bucket: unknown, as the live reader has it.
_OVERFLOWED = 1e-6
#: ``{kind}_max`` field -> the overflow figure that makes it unknown.
_MAXIMA = {
    "prompt_max": "prompt_overflow",
    "output_max": "output_overflow",
    "context_max": "context_overflow",
    "requested_context_max": "requested_overflow",
}


def _measurements(v: dict[str, float], window_s: float) -> Measurements:
    v = {k: x for k, x in v.items() if not (k in _MAXIMA and v.get(_MAXIMA[k], 0.0) > _OVERFLOWED)}
    timers = {}
    for name in ENGINE_TIMERS:
        cells = [v.get(f"timer:{name}:{q}") for q in (50, 95, 99)]
        if any(c is not None for c in cells):
            timers[name] = Percentiles(*cells)
    p99 = [v.get("context_p99")]
    top = [v.get("context_max")]
    if v.get("prompt_p99") is not None and v.get("output_max") is not None:
        p99.append(v["prompt_p99"] + v["output_max"])
    if v.get("prompt_max") is not None and v.get("output_max") is not None:
        top.append(v["prompt_max"] + v["output_max"])
    known_p99 = [x for x in p99 if x is not None]
    known_top = [x for x in top if x is not None]

    def _int(name: str) -> int | None:
        return int(v[name]) if name in v else None

    fields: dict[str, Any] = {
        "requests": _int("requests"),
        "request_rate_per_s": v.get("request_rate_per_s"),
        "context_p99": min(known_p99) if known_p99 else None,
        "context_max": min(known_top) if known_top else None,
        "requested_context_max": v.get("requested_context_max"),
        "prompt_p99": v.get("prompt_p99"),
        "output_p99": v.get("output_p99"),
        "prompt_mean": v.get("prompt_mean"),
        "output_mean": v.get("output_mean"),
        "kv_usage": min(1.0, v["kv_usage"]) if "kv_usage" in v else None,
        "waiting_mean": v.get("waiting_mean"),
        "waiting_growth_per_min": v.get("waiting_growth_per_min"),
        "preemptions_per_min": v.get("preemptions_per_min"),
        "running_at_preemption": _int("running_at_preemption"),
        "running_peak": _int("running_peak"),
        "adapter_working_set": _int("adapter_working_set"),
        "adapter_loads_per_min": v.get("adapter_loads_per_min"),
        "adapter_unloads_per_min": v.get("adapter_unloads_per_min"),
        "prefix_hit_rate": v.get("prefix_hit_rate"),
        "window_s": window_s,
    }
    return Measurements(**fields, timers=timers)
