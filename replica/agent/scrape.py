"""Read a vLLM engine's load, cache and adapter figures from ``/metrics`` and ``/v1/models``.

Parsing is separate from fetching so it can be tested on real vLLM output saved to a file.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from routing.lora_slots import LORA_INFO_METRIC, LoraInfo, latest_lora_info
from routing.state import MAX_LIFETIME_COUNT, MAX_REQUEST_COUNT


@dataclass(frozen=True)
class EngineSnapshot:
    """One reading of an engine, summed over its engine cores (data-parallel ranks)."""

    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    preemptions_total: int = 0
    max_loras: int | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    #: Engine steps that produced output, over the engine's life (the count of vLLM's
    #: ``vllm:iteration_tokens_total`` histogram); None where the engine does not export it.
    steps_total: int | None = None
    #: Base models served (``/v1/models`` entries without a parent), in the engine's order.
    models: tuple[str, ...] = ()
    #: Adapters registered on the engine (``/v1/models`` entries with a parent).
    adapters: frozenset[str] = frozenset()
    read_at: float = field(default_factory=time.time)


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    raw = labels.get(name)
    try:
        return int(raw) if raw not in (None, "", "None") else None
    except ValueError:
        return None


#: The samples read as figures, and the highest each can truly be (KV usage is a fraction, but
#: a rank may report a hair over 1; routing clamps it).
_BOUNDS = {
    "vllm:kv_cache_usage_perc": math.inf,
    "vllm:num_requests_running": MAX_REQUEST_COUNT,
    "vllm:num_requests_waiting": MAX_REQUEST_COUNT,
    "vllm:num_preemptions_total": MAX_LIFETIME_COUNT,
    "vllm:iteration_tokens_total_count": MAX_LIFETIME_COUNT,
}


def parse_metrics(text: str) -> dict[str, Any]:
    """The figures fleetgate reads from vLLM's Prometheus text, as ``EngineSnapshot`` fields.

    ``vllm:lora_requests_info`` is read as ``routing.lora_slots`` reads it (the latest sample).
    Raises ``ValueError`` on a figure no engine can report (NaN, infinite, negative, or past
    any engine's count): a scrape glitch, after which the agent keeps its last figures, as the
    gateway does with such a sample. Read as it was, an infinite count ended the agent's loop
    for good, and a NaN KV usage read as an empty cache (the routing review, session 46).
    """
    kv_usage: list[float] = []
    running = waiting = preemptions = 0.0
    lora_samples: list[tuple[Mapping[str, str], float]] = []
    block_size: int | None = None
    num_blocks: int | None = None
    steps: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            bound = _BOUNDS.get(name)
            if bound is not None and not 0 <= value <= bound:  # NaN fails it too
                raise ValueError(f"{name} read {value!r}: a scrape glitch, not a figure")
            if name == "vllm:kv_cache_usage_perc":
                kv_usage.append(value)
            elif name == "vllm:num_requests_running":
                running += value
            elif name == "vllm:num_requests_waiting":
                waiting += value
            elif name == "vllm:num_preemptions_total":
                preemptions += value
            elif name == "vllm:iteration_tokens_total_count":
                steps = (steps or 0.0) + value
            elif name == LORA_INFO_METRIC:
                lora_samples.append((labels, value))
            elif name == "vllm:cache_config_info":
                block_size = _int_label(labels, "block_size")
                blocks = _int_label(labels, "num_gpu_blocks")
                num_blocks = blocks if blocks is None else (num_blocks or 0) + blocks
    lora = latest_lora_info(lora_samples) or LoraInfo()
    return {
        # Engines of one replica share nothing; the fullest one is the one that preempts first.
        "kv_usage": max(kv_usage, default=0.0),
        "running": int(running),
        "waiting": int(waiting),
        "preemptions_total": int(preemptions),
        "max_loras": lora.max_loras,
        "running_adapters": lora.running,
        "waiting_adapters": lora.waiting,
        "block_size": block_size,
        "num_gpu_blocks": num_blocks,
        "steps_total": None if steps is None else int(steps),
    }


def parse_models(body: Mapping[str, Any]) -> tuple[tuple[str, ...], frozenset[str]]:
    """``(base models, adapters)`` from a ``/v1/models`` response body."""
    data: Iterable[Mapping[str, Any]] = body.get("data") or []
    models = tuple(str(m["id"]) for m in data if not m.get("parent"))
    adapters = frozenset(str(m["id"]) for m in data if m.get("parent"))
    return models, adapters


class EngineScraper:
    """Fetches ``/health``, ``/metrics`` and ``/v1/models`` from one engine with one client."""

    def __init__(self, engine_url: str, timeout_s: float = 2.0) -> None:
        self.engine_url = engine_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.engine_url, timeout=timeout_s)

    async def healthy(self) -> bool:
        """True when ``/health`` answers 200."""
        try:
            return (await self._client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def snapshot(self) -> EngineSnapshot:
        """One full reading; raises ``httpx.HTTPError`` when the engine does not answer.

        Its ``read_at`` is when ``/metrics`` was asked for: the engine's figures are at least
        that fresh, and a request that ended after it may still be counted in them (the
        gateway's ``ReplicaState.finished_since_read`` relies on that). Stamping the answer's
        arrival instead, a busy engine's slow page would pass for a reading after the ends.
        """
        asked_at = time.time()
        metrics = await self._client.get("/metrics")
        metrics.raise_for_status()
        models = await self._client.get("/v1/models")
        models.raise_for_status()
        figures = parse_metrics(metrics.text)
        served, adapters = parse_models(models.json())
        return EngineSnapshot(**figures, models=served, adapters=adapters, read_at=asked_at)

    async def close(self) -> None:
        await self._client.aclose()
