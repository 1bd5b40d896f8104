"""``/metrics`` of a simulated replica: vLLM's names and labels, parsed by prometheus_client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from replica.sim.fleet import SimFleet, start_sim_fleet

PROMPT = "metrics need a prompt that spans several blocks of tokens " * 8

ENGINE_SAMPLES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
]


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with start_sim_fleet(
        1, profile="tiny", speed=1000, kv_events=None, model="m-sim", max_loras=2
    ) as running:
        yield running


async def _samples(http: aiohttp.ClientSession, url: str) -> list[Sample]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[Sample], name: str) -> float:
    (sample,) = [s for s in samples if s.name == name]
    return sample.value


async def test_vllm_metric_names_labels_and_values(fleet: SimFleet) -> None:
    url = fleet.urls[0]
    async with aiohttp.ClientSession() as http:
        load = {"lora_name": "ad-1", "lora_path": "/x"}
        async with http.post(url + "/v1/load_lora_adapter", json=load) as resp:
            assert resp.status == 200
        for model in ("m-sim", "m-sim", "ad-1"):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 4}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        samples = await _samples(http, url)

    names = {s.name for s in samples}
    for name in ENGINE_SAMPLES:
        assert name in names, name
        for sample in (s for s in samples if s.name == name):
            assert sample.labels == {"model_name": "m-sim", "engine": "0"}, name

    assert _value(samples, "vllm:time_to_first_token_seconds_count") == 3
    assert _value(samples, "vllm:request_queue_time_seconds_count") == 3
    # vLLM's prefill timer: scheduled to first token, once per request, never more than TTFT.
    assert _value(samples, "vllm:request_prefill_time_seconds_count") == 3
    prefill_s = _value(samples, "vllm:request_prefill_time_seconds_sum")
    assert 0 < prefill_s <= _value(samples, "vllm:time_to_first_token_seconds_sum")
    # Three requests of 4 tokens: 3 inter-token gaps each.
    assert _value(samples, "vllm:inter_token_latency_seconds_count") == 9
    # Their lengths, as `fleetgate advise --engine` reads them (the planning review: absent).
    assert _value(samples, "vllm:request_generation_tokens_sum") == 12
    prompt_sum = _value(samples, "vllm:request_prompt_tokens_sum")
    assert _value(samples, "vllm:request_prompt_tokens_count") == 3
    assert prompt_sum == _value(samples, "vllm:prompt_tokens_total")
    assert _value(samples, "vllm:num_requests_running") == 0
    queries = _value(samples, "vllm:prefix_cache_queries_total")
    hits = _value(samples, "vllm:prefix_cache_hits_total")
    assert 0 < hits < queries  # the repeated base-model prompt hit; the first and adapter ones not

    (cache_info,) = [s for s in samples if s.name == "vllm:cache_config_info"]
    engine_config = fleet.replicas[0].replica.engine_config
    assert cache_info.labels["block_size"] == str(engine_config.block_size)
    assert cache_info.labels["num_gpu_blocks"] == str(engine_config.num_gpu_blocks)
    assert cache_info.labels["engine"] == "0"
    assert cache_info.value == 1

    lora = [s for s in samples if s.name == "vllm:lora_requests_info"]
    assert lora
    assert {s.labels["max_lora"] for s in lora} == {"2"}
    assert set(lora[0].labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
    # vLLM keeps one series per label combination seen; the adapter request made one.
    assert any(s.labels["running_lora_adapters"] == "ad-1" for s in lora)
