"""Prometheus metrics of one simulated replica, under vLLM 0.32's names, labels and buckets.

Each replica gets its own ``CollectorRegistry`` so several replicas in one process each serve
their own ``/metrics``. Labels are vLLM's: ``model_name`` and ``engine`` (the engine index, "0")
on the engine metrics; ``vllm:lora_requests_info`` and ``vllm:cache_config_info`` are vLLM's
info-style gauges.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from replica.sim.engine import EngineConfig, EngineStats

# vLLM's default bucket families (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def one_two_five(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets of request lengths."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


class ReplicaMetrics:
    """The metric families of one replica; the driver feeds them, ``/metrics`` renders them."""

    def __init__(self, model_name: str, config: EngineConfig, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        values = (model_name, str(engine_index))
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=tuple(buckets), registry=reg)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(*values)
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(*values)
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(*values)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(*values)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*values)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(*values)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(*values)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(*values)
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*names, "finished_reason"], registry=reg,
        )
        self._success_values = values
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.", TTFT_BUCKETS,
        ).labels(*values)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", ITL_BUCKETS,
        ).labels(*values)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        # vLLM's own prefill timer: first scheduled to first token (what TTFT adds to the queue).
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        # Request lengths, as vLLM buckets them (1-2-5 up to the model's length): what
        # `fleetgate advise --engine` sizes --max-model-len from.
        length_buckets = one_two_five(config.model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", length_buckets,
        ).labels(*values)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            length_buckets,
        ).labels(*values)

        self._max_lora = config.max_loras
        self._lora_info: Gauge | None = None
        if config.max_loras > 0:
            # vLLM leaves earlier label combinations in place and stamps the current one with
            # the time; readers take the series with the latest value.
            self._lora_info = Gauge(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg,
            )
        cache_info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto" if config.kv_dtype == "bf16" else config.kv_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
            "prefix_caching_hash_algo": "sha256",
            "engine": str(engine_index),
        }
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            list(cache_info), registry=reg,
        ).labels(**cache_info).set(1)
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0
        self._last_lora_labels: tuple[str, str] | None = None

    def update_engine(
        self, stats: EngineStats, running_adapters: Iterable[str], now_s: float
    ) -> None:
        """Refresh gauges and advance counters from an engine snapshot taken after a step."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        # The engine reports cumulative totals; Prometheus counters only move forward.
        self.prefix_queries.inc(max(0, stats.prefix_queries_tokens - self._last_queries))
        self.prefix_hits.inc(max(0, stats.prefix_hits_tokens - self._last_hits))
        self.preemptions.inc(max(0, stats.preemptions - self._last_preemptions))
        self._last_queries = stats.prefix_queries_tokens
        self._last_hits = stats.prefix_hits_tokens
        self._last_preemptions = stats.preemptions
        if self._lora_info is not None:
            labels = (",".join(sorted(stats.waiting_adapters)), ",".join(sorted(running_adapters)))
            if labels != self._last_lora_labels:
                self._last_lora_labels = labels
                self._lora_info.labels(str(self._max_lora), *labels).set(now_s)

    def request_finished(self, finished_reason: str) -> None:
        """Count one finished request (``length``, ``stop`` or ``abort``)."""
        self._success.labels(*self._success_values, finished_reason).inc()

    def render(self) -> bytes:
        """The text exposition of this replica's registry."""
        return generate_latest(self.registry)
