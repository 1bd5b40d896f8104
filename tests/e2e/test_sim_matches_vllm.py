"""The simulated replica speaks the same wire formats as a real vLLM engine.

Both are driven with the same tokenizer and block size; the raw KV-event messages are compared
field by field (msgpack shape, event keys and value types) and decoded by the one decoder the
agent uses, and both ``/metrics`` pages are parsed with prometheus_client and compared by metric
family and label names. A simulator that drifted from vLLM's formats would fail here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from replica.kv_events import BlockStored, decode_payload
from replica.launcher import VllmEngine
from replica.sim.fleet import start_sim_fleet
from replica.tiny_model import TinyModel
from tests.e2e.conftest import SERVED_MODEL

pytestmark = [pytest.mark.e2e]

BLOCK_SIZE = 32  # the real engines' --block-size (the CPU backend needs a multiple of 32)
_unique = itertools.count()

#: vLLM metric families the gateway, agent, dashboards and alerts read (DESIGN.md).
SHARED_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
)


def _prompt() -> str:
    tag = f"wire check {next(_unique)} at {time.time_ns()} "
    return tag + " ".join(["every replica speaks the same wire format to the agent"] * 12)


async def _stored_message(endpoint: str, base_url: str, model: str) -> list[Any]:
    """Send a fresh prompt and return the first raw KV-event message carrying a BlockStored."""
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                # ZMQ subscriptions join late: keep sending fresh prompts until one is seen.
                reply = await http.post(
                    "/v1/completions",
                    json={"model": model, "prompt": _prompt(), "max_tokens": 2},
                )
                assert reply.status_code == 200, reply.text
                while await sub.poll(500):
                    frames = await sub.recv_multipart()
                    raw = msgspec.msgpack.decode(frames[2])
                    if any(_event_type(e) == "BlockStored" for e in raw[1]):
                        return [frames, raw]
            raise AssertionError(f"no BlockStored event from {endpoint} within 60 s")
    finally:
        sub.close(linger=0)


def _event_type(event: Any) -> str:
    return event["type"] if isinstance(event, dict) else event[0]


def _shape(value: Any) -> Any:
    """The msgpack type structure of ``value``: lists by their element types, maps by key."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return ("list", sorted({repr(_shape(item)) for item in value}))
    return type(value).__name__


async def _metrics(base_url: str) -> dict[str, set[str]]:
    """Metric family -> the label names its samples carry (histogram ``le`` dropped)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        labels = families.setdefault(family.name, set())
        for sample in family.samples:
            labels.update(name for name in sample.labels if name != "le")
    return families


def _first_stored(events: Iterable[Any]) -> dict[str, Any]:
    return next(e for e in events if _event_type(e) == "BlockStored")


async def test_sim_kv_events_and_metrics_match_a_real_vllm_engine(
    vllm_engine: VllmEngine, tiny_model: TinyModel
) -> None:
    async with start_sim_fleet(
        1,
        model=SERVED_MODEL,
        profile="tiny",
        block_size=BLOCK_SIZE,
        tokenizer_dir=str(tiny_model.model_dir),
        speed=50.0,
    ) as fleet:
        sim_endpoint = fleet.kv_event_endpoints[0]
        assert sim_endpoint is not None
        (real_frames, real), (sim_frames, sim) = await asyncio.gather(
            _stored_message(vllm_engine.spec.subscriber_endpoint, vllm_engine.url, SERVED_MODEL),
            _stored_message(sim_endpoint, fleet.urls[0], SERVED_MODEL),
        )
        real_metrics, sim_metrics = await asyncio.gather(
            _metrics(vllm_engine.url), _metrics(fleet.urls[0])
        )

    # Three frames: topic, 8-byte big-endian sequence number, msgpack payload.
    for frames in (real_frames, sim_frames):
        assert len(frames) == 3 and frames[0] == b"kv" and len(frames[1]) == 8
    # The payload: [timestamp, events, data_parallel_rank], events as msgpack maps with "type".
    assert [type(part).__name__ for part in sim] == [type(part).__name__ for part in real]
    real_event, sim_event = _first_stored(real[1]), _first_stored(sim[1])
    assert isinstance(real_event, dict) and isinstance(sim_event, dict)
    assert sorted(sim_event) == sorted(real_event), "BlockStored keys differ"
    for key in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name"):
        if real_event[key] is not None and sim_event[key] is not None:
            assert _shape(sim_event[key]) == _shape(real_event[key]), key
    assert sim_event["block_size"] == real_event["block_size"] == BLOCK_SIZE

    # One decoder reads both, into the same structure.
    for frames in (real_frames, sim_frames):
        batch = decode_payload(frames[2])
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored
        for event in stored:
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size

    # /metrics: every family fleetgate reads exists on both, with the same label names. vLLM
    # turns every cache-config field into a label of the info metric (dozens, changing between
    # releases); there the sim must carry a subset that includes what fleetgate reads.
    for family in SHARED_FAMILIES:
        assert family in real_metrics, f"real vLLM lacks {family}"
        assert family in sim_metrics, f"the simulator lacks {family}"
        if family == "vllm:cache_config_info":
            assert {"block_size", "num_gpu_blocks"} <= sim_metrics[family]
            assert sim_metrics[family] <= real_metrics[family], (
                f"sim labels vLLM lacks: {sorted(sim_metrics[family] - real_metrics[family])}"
            )
            continue
        assert sim_metrics[family] == real_metrics[family], (
            f"{family}: sim labels {sorted(sim_metrics[family])} "
            f"!= vLLM labels {sorted(real_metrics[family])}"
        )
