"""`fleetgate advise --prometheus`: the PromQL it sends and how answers become a snapshot."""

from __future__ import annotations

from dataclasses import replace

import httpx

from planning.advise import advise, changes
from planning.advise.prometheus_source import fetch_prometheus_pools

CACHE_INFO = {
    "__name__": "vllm:cache_config_info",
    "pool": "chat",
    "block_size": "16",
    "num_gpu_blocks": "27000",
    "cache_dtype": "auto",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
}

#: A query's distinctive text -> (labels, value) series it answers.
ANSWERS: dict[str, list[tuple[dict[str, str], float]]] = {
    "histogram_quantile(0.99, sum by (pool, le) (increase(fleetgate_request_context": [
        ({"pool": "chat"}, 2910.0)
    ],
    "histogram_quantile(1, sum by (pool, le) (increase(fleetgate_request_context": [
        ({"pool": "chat"}, 3072.0)
    ],
    "sum by (pool) (increase(fleetgate_request_context_tokens_count": [({"pool": "chat"}, 900.0)],
    "max by (pool) (avg_over_time(vllm:kv_cache_usage_perc": [({"pool": "chat"}, 0.4)],
    "60 * sum by (pool) (rate(vllm:num_preemptions_total": [({"pool": "chat"}, 0.0)],
    "avg by (pool) (avg_over_time(vllm:num_requests_waiting": [({"pool": "chat"}, 0.0)],
    "count by (pool) (vllm:cache_config_info)": [({"pool": "chat"}, 4.0)],
    "vllm:request_prefill_time_seconds_bucket": [({"pool": "chat"}, 120.0)],
}


def _handler(request: httpx.Request) -> httpx.Response:
    promql = request.url.params["query"]
    if promql == "vllm:cache_config_info":
        series = [(CACHE_INFO, 1.0)]
    else:
        series = next((v for k, v in ANSWERS.items() if k in promql), [])
    result = [{"metric": labels, "value": [0, str(value)]} for labels, value in series]
    return httpx.Response(200, json={"status": "success", "data": {"result": result}})


def test_prometheus_answers_become_a_pool_snapshot() -> None:
    client = httpx.Client(transport=httpx.MockTransport(_handler))
    pools = fetch_prometheus_pools("http://prom:9090", client, window="10m")
    pool = pools["chat"]
    assert pool.replicas == 4
    assert pool.flags.num_gpu_blocks == 27000
    assert pool.flags.source("block_size") == "engine-reported"
    m = pool.measured
    assert (m.context_p99, m.context_max, m.requests) == (2910.0, 3072.0, 900)
    assert m.window_s == 600 and m.timers["prefill"].p99_ms == 120.0
    # --max-model-len is not in Prometheus: with it given, the length rule runs.
    assert changes(advise(pool)) == {}
    given = replace(pool, flags=replace(pool.flags, max_model_len=131072))
    assert changes(advise(given)) == {"--max-model-len": 3648}
