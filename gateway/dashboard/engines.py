"""The engines' own ``/metrics`` (vLLM's names), read for the dashboard and labelled by pool.

The gateway's health poll keeps only a few gauges per replica; the page's per-pool timers need
vLLM's histograms, so each dashboard refresh reads every replica's ``/metrics`` once (bounded
by a short timeout; a replica that does not answer is left out and shown as such).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from routing.state import ReplicaState

log = logging.getLogger(__name__)

#: The engine families the page shows: the four gauges and four timers of ``fleetgate advise``.
ENGINE_FAMILIES = frozenset(
    {
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:num_preemptions",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
    }
)


@dataclass(frozen=True)
class EngineSample:
    """One sample of one engine, with the replica and pool the gateway knows it as."""

    name: str
    labels: dict[str, str]
    value: float


def parse_engine_metrics(text: str, replica: str, pool: str) -> list[EngineSample]:
    """The samples of ``ENGINE_FAMILIES`` in an engine's exposition, labelled replica and pool."""
    out = []
    for family in text_string_to_metric_families(text):
        if family.name not in ENGINE_FAMILIES:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {**sample.labels, "replica": replica, "pool": pool}
            out.append(EngineSample(sample.name, labels, float(sample.value)))
    return out


async def read_engines(
    session: aiohttp.ClientSession, replicas: Iterable[ReplicaState], timeout_s: float = 1.5
) -> tuple[list[EngineSample], set[str]]:
    """Every replica's samples, read concurrently; and the replicas that did not answer."""
    states = list(replicas)
    results = await asyncio.gather(*(_read_one(session, s, timeout_s) for s in states))
    samples: list[EngineSample] = []
    unreadable: set[str] = set()
    for state, result in zip(states, results, strict=True):
        if result is None:
            unreadable.add(str(state.replica_id))
        else:
            samples.extend(result)
    return samples, unreadable


async def _read_one(
    session: aiohttp.ClientSession, state: ReplicaState, timeout_s: float
) -> list[EngineSample] | None:
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(f"{state.url}/metrics", timeout=timeout) as response:
            if response.status != 200:
                return None
            text = await response.text()
        return parse_engine_metrics(text, str(state.replica_id), state.pool)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("dashboard: reading %s/metrics failed: %s", state.url, exc)
        return None
