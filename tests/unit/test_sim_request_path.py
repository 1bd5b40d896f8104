"""The request path: one server in front of each simulated engine, and its fit from bursts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from planning.calibrate.request_path import Burst, fit_request_path, simulate_burst
from planning.simulator import SimulationConfig
from planning.simulator.api import simulate
from planning.simulator.config import prepare_requests
from replica.sim.engine import EngineConfig
from replica.sim.request_path import RequestPath
from replica.sim.step_time import StepTimeModel
from traces.format import TraceRecord

#: About the CPU engine's calibrated figures (bench/sim_fidelity.py, through the gateway).
TRUE = StepTimeModel(
    base_s=0.0015, prefill_token_s=6e-6, decode_seq_s=6e-5, context_token_s=0.0,
    request_overhead_s=0.008, request_work_s=0.003, stream_token_s=0.0004,
)
SHAPES = [(16, 32, 8), (16, 32, 32), (32, 32, 8), (32, 32, 32)]


def _config(step: StepTimeModel) -> EngineConfig:
    return EngineConfig.from_profile(
        "tiny", block_size=32, num_gpu_blocks_override=256, max_model_len=2048,
        max_num_seqs=16, max_num_batched_tokens=2048, step_time=step.as_mapping(),
    )


def _lone(step: StepTimeModel) -> StepTimeModel:
    return dataclasses.replace(step, request_work_s=0.0, stream_token_s=0.0)


def test_a_profile_without_a_measured_path_has_none() -> None:
    assert RequestPath.of(None) is None
    assert RequestPath.of(dataclasses.replace(TRUE, request_overhead_s=0.0, request_work_s=0.0,
                                              stream_token_s=0.0)) is None


def test_the_path_serves_one_job_at_a_time() -> None:
    path = RequestPath.of(TRUE)
    assert path is not None
    # Work 3 ms + hop (8 - 3 - 0.4 = 4.6 ms): the first request reaches the engine at 7.6 ms.
    assert path.admit(0.0) == pytest.approx(0.0076)
    # The second waits for the first's work, not for its hop.
    assert path.admit(0.0) == pytest.approx(0.0106)
    # 10 tokens at 0.4 ms queue behind both admissions (free at 6 ms).
    assert path.deliver(0.001, 10) == pytest.approx(0.010)
    # An idle path serves at once.
    assert path.deliver(1.0, 1) == pytest.approx(1.0004)


def test_a_lone_request_pays_exactly_the_calibrated_overhead() -> None:
    step = TRUE.step_s(32, 0, 0)  # its prefill step (which also makes its first token)
    makespan, ttft = simulate_burst(_config(TRUE), 1, 32, 1)
    assert ttft == pytest.approx(TRUE.request_overhead_s + step)
    assert makespan == pytest.approx(ttft)


def test_a_burst_waits_for_the_path_and_a_lone_request_does_not() -> None:
    with_path = _config(TRUE)
    without = _config(_lone(TRUE))
    assert simulate_burst(with_path, 1, 32, 8) == pytest.approx(simulate_burst(without, 1, 32, 8))
    burst, _ = simulate_burst(with_path, 32, 32, 32)
    engine_only, _ = simulate_burst(without, 32, 32, 32)
    # 32 admissions and 1,024 deliveries, one at a time: at least 32 x 3 ms + 1,024 x 0.4 ms.
    assert burst >= 32 * 0.003 + 1024 * 0.0004
    assert burst > 1.5 * engine_only


def test_the_fit_recovers_the_path_from_bursts() -> None:
    config = _config(TRUE)
    bursts = [Burst(*shape, *simulate_burst(config, *shape)) for shape in SHAPES]
    fit = fit_request_path(_config(_lone(TRUE)), bursts)
    assert fit.model.request_work_s == pytest.approx(TRUE.request_work_s, rel=0.05)
    assert fit.model.stream_token_s == pytest.approx(TRUE.stream_token_s, rel=0.05)
    assert all(abs(r.error) < 0.02 and r.path_bound for r in fit.residuals)
    assert "ms per streamed token" in fit.table()


def test_stalled_repeats_do_not_move_the_fit() -> None:
    """Two of five repeats of every shape stalled by half a second (a busy shared core): the
    lower quartile of the repeats is what the path fit sees, so it recovers the path still."""
    config = _config(TRUE)
    bursts = []
    for shape in SHAPES:
        makespan, ttft = simulate_burst(config, *shape)
        bursts += [Burst(*shape, makespan + stall, ttft + stall)
                   for stall in (0.0, 0.5, 0.002, 0.6, 0.001)]
    fit = fit_request_path(_config(_lone(TRUE)), bursts)
    assert fit.model.request_work_s == pytest.approx(TRUE.request_work_s, rel=0.05)
    assert fit.model.stream_token_s == pytest.approx(TRUE.stream_token_s, rel=0.05)
    assert all(r.repeats == 5 for r in fit.residuals)
    assert "(lower quartile of 5)" in fit.table()


def test_bursts_the_engine_explains_leave_no_path_work() -> None:
    lone = _lone(TRUE)
    bursts = [Burst(*shape, *simulate_burst(_config(lone), *shape)) for shape in SHAPES]
    fit = fit_request_path(_config(lone), bursts)
    assert fit.model.request_work_s == 0.0
    assert fit.model.stream_token_s == 0.0
    assert not any(r.path_bound for r in fit.residuals)


def test_the_fit_caps_the_path_work_at_the_lone_overhead() -> None:
    # Bursts far slower than any lone request could pay for: the admission work is capped.
    bursts = [Burst(*shape, 100 * simulate_burst(_config(TRUE), *shape)[0], 0.1)
              for shape in SHAPES]
    fit = fit_request_path(_config(_lone(TRUE)), bursts)
    model = fit.model
    assert model.request_work_s + model.stream_token_s <= TRUE.request_overhead_s + 1e-12


def _burst_trace(n: int) -> list[TraceRecord]:
    return [TraceRecord(0, 64, 16, (i * 2, i * 2 + 1)) for i in range(n)]


def test_simulate_queues_a_burst_on_the_request_path(tmp_path: Path) -> None:
    profile = tmp_path / "calibrated.yaml"
    profile.write_text(yaml.safe_dump({
        "hardware": "l4", "model": "tiny", "block_size": 32, "num_gpu_blocks_override": 256,
        "max_model_len": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
        "step_time": TRUE.as_mapping(),
    }), encoding="utf-8")
    lone_profile = tmp_path / "lone.yaml"
    lone_profile.write_text(profile.read_text().replace("request_work_s: 0.003",
                                                        "request_work_s: 0.0").replace(
        "stream_token_s: 0.0004", "stream_token_s: 0.0"), encoding="utf-8")

    def ttfts(path: str, n: int) -> list[float]:
        config = SimulationConfig(replicas=1, profile=path, trace_block_size=32, model="tiny")
        run = simulate(prepare_requests(_burst_trace(n)), ["round-robin"], config).runs[
            "round-robin"]
        return sorted(o.first_token_s - o.arrival_s for o in run.outcomes)

    # Alone, the path costs what calibration measured for a lone request, with or without work.
    assert ttfts(str(profile), 1) == pytest.approx(ttfts(str(lone_profile), 1))
    # In a burst the last admission waits for 15 others' work: 15 x 3 ms more than without.
    burst, lone = ttfts(str(profile), 16), ttfts(str(lone_profile), 16)
    assert burst[-1] - lone[-1] >= 15 * TRUE.request_work_s
