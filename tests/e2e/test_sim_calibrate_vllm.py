"""``fleetgate sim calibrate`` against a real vLLM CPU engine writes a profile the simulator runs.

The session's first engine (tests/e2e/conftest.py) is measured with the quick workload; the
profile must copy the engine's KV cache shape from its metrics, hold a physically sensible step
time (every coefficient >= 0, a step costs something, prefill costs grow with tokens), and
drive ``fleetgate simulate`` on a small shared-prefix trace to completion. Timing accuracy
against this engine is the fidelity benchmark's job (docs/benchmarks/sim-fidelity.md), not a
test's: a shared CPU's noise would make any bound either loose or flaky.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleetgate.cli import main as fleetgate
from planning.simulator import SimulationConfig
from planning.simulator.api import simulate
from planning.simulator.config import prepare_requests
from replica.launcher import VllmEngine
from replica.sim.engine import EngineConfig
from replica.sim.profiles import load_preset
from tests.e2e.conftest import KV_BLOCKS_PER_ENGINE, SERVED_MODEL
from traces.format import TraceRecord

pytestmark = [pytest.mark.e2e]


async def test_calibrate_a_real_engine_writes_a_usable_profile(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    profile = tmp_path / "cpu-tiny.yaml"
    argv = ["sim", "calibrate", "--engine", vllm_engine.url, "--output", str(profile), "--quick"]
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
