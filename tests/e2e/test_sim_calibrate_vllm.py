"""``fleetgate sim calibrate`` against a real vLLM CPU engine writes a profile the simulator runs.

The session's first engine (tests/e2e/conftest.py) is measured with the quick workload; the
profile must copy the engine's KV cache shape from its metrics, hold a physically sensible step
time (every coefficient >= 0, a step costs something, prefill costs grow with tokens), and
drive ``fleetgate simulate`` on a small shared-prefix trace to completion. With ``--adapter`` it
also times loading one of the tiny LoRA adapters and leaves the engine without it. Timing accuracy
against this engine is the fidelity benchmark's job (docs/benchmarks/sim-fidelity.md), not a
test's: a shared CPU's noise would make any bound either loose or flaky.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from fleetgate.cli import main as fleetgate
from planning.calibrate.adapters import adapter_size_bytes
from planning.simulator import SimulationConfig
from planning.simulator.api import simulate
from planning.simulator.config import prepare_requests
from replica.launcher import VllmEngine
from replica.sim.engine import EngineConfig
from replica.sim.profiles import load_preset
from replica.tiny_model import TinyModel
from tests.e2e.conftest import KV_BLOCKS_PER_ENGINE, SERVED_MODEL
from traces.format import TraceRecord

pytestmark = [pytest.mark.e2e]


async def _served_models(url: str) -> set[str]:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    return {model["id"] for model in response.json()["data"]}


async def test_calibrate_a_real_engine_writes_a_usable_profile(
    vllm_engine: VllmEngine, tiny_model: TinyModel, tmp_path: Path
) -> None:
    profile = tmp_path / "cpu-tiny.yaml"
    adapter_path = next(iter(tiny_model.adapters.values()))
    argv = [
        "sim", "calibrate", "--engine", vllm_engine.url, "--output", str(profile), "--quick",
        # A name no other test loads; calibration unloads it (and its stand-ins) when done.
        "--adapter", f"fg-calibrate-probe={adapter_path}",
        "--max-loras", str(vllm_engine.spec.max_loras),
        "--max-cpu-loras", str(vllm_engine.spec.max_cpu_loras),
    ]
    code = await asyncio.wait_for(asyncio.to_thread(fleetgate, argv), timeout=600)
    assert code == 0

    settings = load_preset(str(profile))
    assert settings["block_size"] == 32
    assert settings["num_gpu_blocks_override"] == KV_BLOCKS_PER_ENGINE
    assert settings["max_model_len"] == 2048
    step = settings["step_time"]
    assert all(value >= 0 for value in step.values())
    assert step["base_s"] + step["request_overhead_s"] > 0
    assert step["prefill_token_s"] > 0  # a longer prompt never prefills faster
    # The adapter's load, timed on vLLM: its size as read from disk, a bandwidth that
    # reproduces the load call (the tiny adapter's slot stage is within the noise, so the
    # host-to-device bandwidth may stay the base profile's).
    assert settings["adapter_default_size_mb"] == pytest.approx(
        adapter_size_bytes(adapter_path) / 1e6, rel=1e-3
    )
    assert settings["lora_storage_gbps"] > 0
    assert settings["max_loras"] == vllm_engine.spec.max_loras
    assert "fg-calibrate-probe" not in await _served_models(vllm_engine.url)

    config = EngineConfig.from_profile(str(profile))
    assert config.step_time is not None
    # Eight requests over two shared 4-block prefixes (trace block = engine block = 32 tokens).
    records = [
        TraceRecord(i * 100, 6 * 32, 8, (i % 2, 10 + i % 2, 20 + i % 2, 30 + i % 2, 100 + i,
                                         200 + i))
        for i in range(8)
    ]
    sim_config = SimulationConfig(
        replicas=1, profile=str(profile), trace_block_size=32, model=SERVED_MODEL
    )
    report = await asyncio.to_thread(
        simulate, prepare_requests(records), ["round-robin"], sim_config
    )
    outcomes = report.runs["round-robin"].outcomes
    assert len(outcomes) == 8
    assert all(o.finish_s > o.first_token_s > o.arrival_s for o in outcomes)
    # Requests 2..7 find their 4-block prefix cached by the first two.
    assert sum(o.cached_tokens for o in outcomes) == 6 * 4 * 32
