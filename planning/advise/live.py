"""Read a live fleet: the engines' ``/metrics`` and ``/v1/models``, and the gateway if given.

``--gateway URL`` lists the replicas (``/admin/replicas``, with the admin key) and their pools,
and its ``/metrics`` carries what only the gateway sees: every request's length per pool and the
adapter requests, loads and unloads. ``--engine [POOL=]URL`` reads engines directly (no gateway:
lengths then come from vLLM's own histograms). Engines are scraped ``samples`` times,
``interval_s`` apart: gauges need a window (a queue that grows, the running level at which
preemptions start), which one scrape cannot show.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from planning.advise.engine_metrics import (
    EngineReading,
    Histogram,
    flags_of,
    max_model_len_of,
    parse_engine_metrics,
)
from planning.advise.measure import AdapterActivity, Lengths, Sample, engine_lengths, measurements
from planning.advise.model import EngineFlags, PoolSnapshot
from planning.triage.model import SourceError

_LENGTH_FAMILIES = {
    "fleetgate_request_prompt_tokens": "prompt",
    "fleetgate_request_output_tokens": "output",
    "fleetgate_request_context_tokens": "context",
    "fleetgate_request_budget_tokens": "budget",
}


@dataclass(frozen=True)
class Target:
    """One engine to read: its URL, pool and the gateway's id for it."""

    url: str
    pool: str = "default"
    replica_id: str = ""


@dataclass
class GatewayReading:
    """What one scrape of the gateway's ``/metrics`` said (lifetime counters)."""

    #: pool -> kind (prompt/output/context/budget) -> histogram.
    lengths: dict[str, dict[str, Histogram]]
    adapter_requests: dict[str, float]
    #: replica id -> loads / unloads.
    loads: dict[str, float]
    unloads: dict[str, float]


def parse_target(text: str) -> Target:
    """``URL`` or ``POOL=URL`` (``--engine``)."""
    pool, sep, url = text.partition("=")
    if not sep or "://" in pool:
        return Target(url=text.rstrip("/"))
    return Target(url=url.rstrip("/"), pool=pool)


def gateway_targets(base_url: str, admin_key: str | None, client: httpx.Client) -> list[Target]:
    """The replicas a gateway routes to, from ``/admin/replicas``."""
    url = base_url.rstrip("/") + "/admin/replicas"
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        response = client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise SourceError(f"{url}: {exc}") from exc
    if response.status_code in (401, 403):
        raise SourceError(
            f"{url}: {response.status_code}: give the admin key (--admin-key or "
            "FLEETGATE_ADMIN_KEY), or read the engines directly with --engine POOL=URL"
        )
    if response.status_code != 200:
        raise SourceError(f"{url}: HTTP {response.status_code}")
    return [
        Target(
            url=str(r["url"]).rstrip("/"),
            pool=str(r.get("pool") or "default"),
            replica_id=str(r.get("replica_id", "")),
        )
        for r in response.json().get("replicas", [])
    ]


def parse_gateway(text: str) -> GatewayReading:
    """Length histograms per pool and adapter activity from a gateway's exposition text."""
    lengths: dict[str, dict[str, Histogram]] = defaultdict(dict)
    requests: dict[str, float] = defaultdict(float)
    loads: dict[str, float] = defaultdict(float)
    unloads: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        kind = _LENGTH_FAMILIES.get(family.name)
        for sample in family.samples:
            labels = sample.labels
            if kind is not None:
                hist = lengths[labels.get("pool", "default")].setdefault(kind, Histogram())
                if sample.name.endswith("_bucket"):
                    hist.buckets[float(labels["le"])] += sample.value
                elif sample.name.endswith("_sum"):
                    hist.total += sample.value
                elif sample.name.endswith("_count"):
                    hist.count += sample.value
            elif sample.name == "fleetgate_adapter_requests_total":
                requests[labels.get("adapter", "")] += sample.value
            elif sample.name == "fleetgate_adapter_loads_total":
                loads[labels.get("replica", "")] += sample.value
            elif sample.name == "fleetgate_adapter_unloads_total":
                unloads[labels.get("replica", "")] += sample.value
    return GatewayReading(dict(lengths), dict(requests), dict(loads), dict(unloads))


def _get(client: httpx.Client, url: str) -> httpx.Response:
    try:
        response = client.get(url)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise SourceError(f"{url}: {exc}") from exc
    return response


def read_live(
    targets: Sequence[Target],
    client: httpx.Client,
    *,
    samples: int = 5,
    interval_s: float = 2.0,
    gateway_url: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    window_lengths: bool = False,
) -> dict[str, PoolSnapshot]:
    """Pool name -> snapshot, from ``samples`` rounds of scrapes ``interval_s`` apart.

    Lengths are lifetime histograms (everything the gateway or engine served since it started),
    or with ``window_lengths`` only what was served between the first and the last round.
    """
    if not targets:
        raise SourceError("no engines to read (the gateway lists no replicas)")
    pools: dict[str, list[Target]] = defaultdict(list)
    for target in targets:
        pools[target.pool].append(target)
    metrics_url = (gateway_url.rstrip("/") + "/metrics") if gateway_url else None
    rounds: list[tuple[float, dict[str, EngineReading]]] = []
    gateway_first = gateway_last = None
    for i in range(max(1, samples)):
        if i:
            sleep(interval_s)
        at = clock()
        readings = {
            t.url: parse_engine_metrics(_get(client, t.url + "/metrics").text) for t in targets
        }
        rounds.append((at, readings))
        if metrics_url is not None and (i == 0 or i == max(1, samples) - 1):
            gateway_last = parse_gateway(_get(client, metrics_url).text)
            gateway_first = gateway_first or gateway_last
    window = rounds[-1][0] - rounds[0][0]
    result = {}
    for pool, members in sorted(pools.items()):
        series = [Sample(at, [readings[t.url] for t in members]) for at, readings in rounds]
        before = gateway_first if window_lengths else None
        lengths = _lengths(gateway_last, pool, before) or engine_lengths(
            series[-1].readings, series[0].readings if window_lengths else None
        )
        activity = _activity(gateway_first, gateway_last, members, len(pools), window)
        model_len = max_model_len_of(_get(client, members[0].url + "/v1/models").json())
        flags = flags_of(series[-1].readings[0], model_len)
        result[pool] = PoolSnapshot(
            pool=pool,
            flags=flags,
            measured=measurements(series, lengths, activity),
            replicas=len(members),
        )
    return result


def _lengths(
    gateway: GatewayReading | None, pool: str, before: GatewayReading | None
) -> Lengths | None:
    if gateway is None or pool not in gateway.lengths:
        return None
    kinds = gateway.lengths[pool]
    if "prompt" not in kinds or "output" not in kinds:
        return None
    if before is not None:
        earlier = before.lengths.get(pool, {})
        kinds = {k: h.since(earlier.get(k, Histogram())) for k, h in kinds.items()}
    return Lengths(kinds["prompt"], kinds["output"], kinds.get("context"), kinds.get("budget"))


def _activity(
    first: GatewayReading | None,
    last: GatewayReading | None,
    members: Sequence[Target],
    pool_count: int,
    window_s: float,
) -> AdapterActivity | None:
    if first is None or last is None:
        return None
    ids = {t.replica_id for t in members}
    # Adapter requests carry no pool label: attribute them only when there is one pool.
    if pool_count == 1:
        grew = {a for a, n in last.adapter_requests.items() if n > first.adapter_requests.get(a, 0)}
        requested = frozenset(grew or {a for a, n in last.adapter_requests.items() if n > 0})
    else:
        requested = frozenset()

    def per_min(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
        if window_s <= 0:
            return None
        moved = sum(after.get(r, 0.0) - before.get(r, 0.0) for r in ids)
        return max(0.0, moved) / window_s * 60

    return AdapterActivity(
        requested, per_min(first.loads, last.loads), per_min(first.unloads, last.unloads)
    )


def overlay_flags(
    pools: Mapping[str, PoolSnapshot], given: Mapping[str, EngineFlags]
) -> dict[str, PoolSnapshot]:
    """Pools with ``--flags pool=FILE`` values on top of what the engines reported."""
    return {
        name: replace(pool, flags=pool.flags.overlay(given[name])) if name in given else pool
        for name, pool in pools.items()
    }
