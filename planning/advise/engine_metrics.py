"""One scrape of one vLLM engine (or a simulated one): gauges, counters, histograms, its flags.

vLLM publishes its cache configuration as the labels of ``vllm:cache_config_info`` (block size,
blocks, KV dtype, prefix caching, gpu_memory_utilization) and its LoRA slot count as the
``max_lora`` label of ``vllm:lora_requests_info``; ``/v1/models`` carries ``max_model_len``.
Those become ``engine-reported`` flags. ``--max-num-seqs``, ``--tensor-parallel-size`` and
chunked prefill are not exported by every version: they come from ``--flags`` or stay defaults.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from planning.advise.model import EngineFlags
from planning.triage.model import SourceError
from routing.lora_slots import LORA_INFO_METRIC, latest_lora_info

#: The four timers (advise name -> vLLM histogram). Prefill is vLLM's own timer (scheduled to
#: first token), not TTFT minus queue: it is absent on engines that do not export it.
ENGINE_TIMERS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}
#: vLLM's own per-request length histograms (a fallback when no gateway is read).
ENGINE_LENGTHS = {
    "prompt": "vllm:request_prompt_tokens",
    "output": "vllm:request_generation_tokens",
}
_HISTOGRAMS = frozenset(ENGINE_TIMERS.values()) | frozenset(ENGINE_LENGTHS.values())


@dataclass
class Histogram:
    """Cumulative buckets (``le`` -> count) with the sum and count, summed over series."""

    buckets: dict[float, float] = field(default_factory=lambda: defaultdict(float))
    total: float = 0.0
    count: float = 0.0

    def add(self, other: Histogram) -> None:
        """Add ``other``'s buckets (replicas of one pool)."""
        for le, value in other.buckets.items():
            self.buckets[le] += value
        self.total += other.total
        self.count += other.count

    def since(self, earlier: Histogram) -> Histogram:
        """What was observed after ``earlier`` (a previous reading of the same histogram)."""
        out = Histogram()
        for le, value in self.buckets.items():
            out.buckets[le] = max(0.0, value - earlier.buckets.get(le, 0.0))
        out.total = max(0.0, self.total - earlier.total)
        out.count = max(0.0, self.count - earlier.count)
        return out


@dataclass
class EngineReading:
    """What one scrape of an engine's ``/metrics`` said."""

    kv_usage: float | None = None
    running: int = 0
    waiting: int = 0
    preemptions_total: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    cache_info: dict[str, str] = field(default_factory=dict)
    max_lora: int | None = None
    adapters: frozenset[str] = frozenset()
    histograms: dict[str, Histogram] = field(default_factory=dict)


def parse_engine_metrics(text: str) -> EngineReading:
    """An ``EngineReading`` from Prometheus exposition text."""
    reading = EngineReading()
    lora_samples: list[tuple[Mapping[str, str], float]] = []
    kv: list[float] = []
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise SourceError(f"not Prometheus exposition text: {exc}") from exc
    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "vllm:kv_cache_usage_perc":
                kv.append(value)
            elif name == "vllm:num_requests_running":
                reading.running += int(value)
            elif name == "vllm:num_requests_waiting":
                reading.waiting += int(value)
            elif name == "vllm:num_preemptions_total":
                reading.preemptions_total += value
            elif name == "vllm:prefix_cache_queries_total":
                reading.prefix_queries += value
            elif name == "vllm:prefix_cache_hits_total":
                reading.prefix_hits += value
            elif name == "vllm:cache_config_info":
                reading.cache_info = dict(labels)
            elif name == LORA_INFO_METRIC:
                lora_samples.append((labels, value))
            elif family.name in _HISTOGRAMS:
                hist = reading.histograms.setdefault(family.name, Histogram())
                if name.endswith("_bucket"):
                    hist.buckets[float(labels["le"])] += value
                elif name.endswith("_sum"):
                    hist.total += value
                elif name.endswith("_count"):
                    hist.count += value
    reading.kv_usage = max(kv) if kv else None
    lora = latest_lora_info(lora_samples)
    if lora is not None:
        reading.max_lora = lora.max_loras
        reading.adapters = lora.running | lora.waiting
    return reading


def max_model_len_of(models_body: Mapping[str, Any]) -> int | None:
    """``max_model_len`` of the base model's card in a ``/v1/models`` body."""
    for card in models_body.get("data") or []:
        if not card.get("parent") and isinstance(card.get("max_model_len"), int):
            return int(card["max_model_len"])
    return None


def flags_of(reading: EngineReading, max_model_len: int | None) -> EngineFlags:
    """The flags an engine reports about itself, all ``engine-reported``."""
    info = reading.cache_info
    values: dict[str, Any] = {
        "block_size": _int(info.get("block_size")),
        "num_gpu_blocks": _int(info.get("num_gpu_blocks")),
        "kv_cache_dtype": info.get("cache_dtype"),
        "enable_prefix_caching": _bool(info.get("enable_prefix_caching")),
        "gpu_memory_utilization": _float(info.get("gpu_memory_utilization")),
        "max_model_len": max_model_len,
    }
    if reading.max_lora is not None:
        # The LoRA info metric exists only with --enable-lora.
        values["enable_lora"] = True
        values["max_loras"] = reading.max_lora
    known = {k: v for k, v in values.items() if v is not None}
    return EngineFlags(**known, sources={k: "engine-reported" for k in known})


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "", "None") else None
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "", "None") else None
    except ValueError:
        return None


def _bool(text: str | None) -> bool | None:
    return {"true": True, "false": False}.get((text or "").lower())
