"""`fleetgate advise` against the embedded stack (gateway + simulated replicas, real HTTP).

It lists the replicas through the gateway's admin API, reads the flags the simulated engines
report (`vllm:cache_config_info`, `vllm:lora_requests_info`, `/v1/models`) and the request
lengths the gateway recorded, and advises a `--max-model-len` from the traffic sent.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
import httpx

from fleetgate.embedded import embedded_stack
from planning.advise import advise
from planning.advise.live import Target, gateway_targets, read_live
from planning.advise.snapshot import parse_snapshot, to_mapping

ADMIN_KEY = "advise-admin"
# Block size and model length of the `tiny` sim preset (replica/sim/profiles).
BLOCK = 16
TINY_MAX_MODEL_LEN = 4096


async def _traffic(url: str, model: str) -> list[int]:
    """Requests of growing length; returns prompt + output tokens of each (engine usage)."""
    lengths = []
    async with aiohttp.ClientSession() as http:
        for i in range(24):
            words = " ".join(f"word{j}" for j in range(20 + 10 * i))
            body = {"model": model, "prompt": f"request {i}: {words}", "max_tokens": 8}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]
            lengths.append(usage["prompt_tokens"] + usage["completion_tokens"])
    return lengths


def _read(gateway: str) -> dict:
    with httpx.Client(timeout=10) as client:
        targets = gateway_targets(gateway, ADMIN_KEY, client)
        assert len(targets) == 2
        return read_live(targets, client, samples=2, interval_s=0.2, gateway_url=gateway)


async def test_advise_reads_sim_flags_and_gateway_lengths() -> None:
    async with embedded_stack(2, sim_profile="tiny", sim_speed=200.0, admin_key=ADMIN_KEY) as s:
        lengths = await _traffic(s.url, s.model)
        pools = await asyncio.to_thread(_read, s.url)
    (pool,) = pools.values()
    assert pool.replicas == 2
    flags = pool.flags
    assert flags.max_model_len == TINY_MAX_MODEL_LEN
    assert flags.block_size == BLOCK and flags.num_gpu_blocks == 256
    assert flags.kv_cache_dtype == "auto" and flags.enable_prefix_caching is True
    assert flags.source("max_model_len") == "engine-reported"
    assert flags.enable_lora is True and flags.max_loras == 2  # the tiny preset's LoRA slots
    m = pool.measured
    assert m.requests == len(lengths)
    assert m.kv_usage is not None and m.preemptions_per_min == 0
    assert m.context_max is not None and m.context_max >= max(lengths)

    rows = {row.flag: row for row in advise(pool)}
    cut = rows["--max-model-len"]
    assert cut.kind == "change", cut
    assert cut.advised % BLOCK == 0
    assert max(lengths) <= cut.advised < TINY_MAX_MODEL_LEN
    assert cut.advised >= math.ceil(m.context_p99 * 1.25)
    # A healthy, idle pool otherwise: nothing about memory or the batch cap.
    assert rows["--kv-cache-dtype"].kind == "no change"
    assert rows["--max-num-seqs"].kind == "no change"


async def test_engine_source_and_saved_snapshot_give_the_same_advice() -> None:
    async with embedded_stack(1, sim_profile="tiny", sim_speed=200.0) as s:
        await _traffic(s.url, s.model)
        (engine,) = s.replica_urls

        def read() -> dict:
            with httpx.Client(timeout=10) as client:
                return read_live([Target(engine, "chat")], client, samples=1)

        pools = await asyncio.to_thread(read)
    pool = pools["chat"]
    # The sim exports vLLM's request-length histograms, so the length rule runs on the engine
    # alone (the planning review: it said "not checked" on the demo fleet). Short requests on
    # the tiny profile's window: a cut, with the warning that budgets were not measured.
    rows = {row.flag: row for row in advise(pool)}
    assert rows["--max-model-len"].kind == "change"
    assert "max_tokens were not measured" in rows["--max-model-len"].evidence
    assert pool.flags.num_gpu_blocks == 256
    again = parse_snapshot(to_mapping(pools))
    assert [r.to_dict() for r in advise(again["chat"])] == [r.to_dict() for r in advise(pool)]
