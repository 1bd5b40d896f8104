"""bench.sim_fidelity's measurement: the per-request median of the real runs, and the noise
floor (the run farthest from it)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

import bench.sim_fidelity as sf
from bench.sim_fidelity import Comparison, SliceRun, farthest_run, main, median_run


def run(ttft_ms: list[float], hits: float = 50.0, queries: float = 100.0) -> SliceRun:
    ttft = [t / 1000.0 for t in ttft_ms]
    return SliceRun(ttft, [t + 0.02 for t in ttft], queries, hits, 0.0, 0.5, float(len(ttft)))


def test_a_stall_in_one_run_does_not_move_the_median() -> None:
    steady = [10.0, 11.0, 12.0, 13.0]
    stalled = [10.0, 800.0, 12.0, 900.0]  # two requests of one run caught by a stall
    measured = median_run([run(steady), run(stalled), run([11.0, 12.0, 11.0, 14.0])])
    assert measured.ttft_s == pytest.approx([0.010, 0.012, 0.012, 0.014])
    assert measured.e2e_s == pytest.approx([0.030, 0.032, 0.032, 0.034])


def test_counters_are_the_median_of_the_runs() -> None:
    measured = median_run([run([1.0], hits=40), run([1.0], hits=60), run([1.0], hits=45)])
    assert measured.prefix_hits == 45
    assert measured.hit_rate == pytest.approx(0.45)


def test_the_noise_floor_is_the_run_farthest_from_the_median() -> None:
    runs = [run([10.0, 12.0]), run([10.0, 30.0]), run([11.0, 12.0])]
    measured = median_run(runs)
    assert farthest_run(runs, measured) is runs[1]
    noise = Comparison.of(runs[1], measured)
    assert noise.ttft_p95 > 1.0  # 30 ms against 12 ms


@pytest.mark.parametrize("flag", ["--runs", "--burst-runs"])
def test_runs_must_leave_a_noise_floor(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([flag, "1"])
    assert f"{flag} must be 2 or more" in capsys.readouterr().err


def test_median_run_needs_runs_of_the_same_requests() -> None:
    with pytest.raises(ValueError):
        median_run([run([1.0, 2.0]), run([1.0])])


PROFILE = """\
hardware: l4
model: tiny
block_size: 32
num_gpu_blocks_override: 256
max_model_len: 2048
max_num_seqs: 16
max_num_batched_tokens: 2048
step_time:
  base_s: 0.0013
  prefill_token_s: 6.0e-06
  decode_seq_s: 4.6e-05
  context_token_s: 1.5e-07
  request_overhead_s: 0.0083
  request_work_s: 0.004
  stream_token_s: 9.4e-05
"""


def test_saved_runs_are_judged_again_without_an_engine(tmp_path: Path) -> None:
    """``--from-runs``: the checks of today's model against the real runs of an earlier run.
    Here the "real" runs are the model's own replay, three times: every error is 0."""
    (tmp_path / "calibrated-profile.yaml").write_text(PROFILE, encoding="utf-8")
    profile = tmp_path / "calibrated-profile.yaml"
    window_s = 0.1
    slices = {}
    for name, make in sf.SLICES.items():
        records = (sf.over_capacity_slice(0, window_s=window_s) if name == "over-capacity"
                   else make(0))
        own = sf.simulate_slice(records, profile)
        slices[name] = {"real_runs": [asdict(own)] * 3}
    bursts = [{"requests": 16, "prompt_tokens": 64, "output_tokens": 32, "makespan_s": m,
               "mean_ttft_s": 0.05} for m in (0.2, 0.21, 0.9)]
    saved = {"seed": 0, "window_s": window_s, "bursts": bursts, "slices": slices}
    (tmp_path / sf.RUNS_FILE).write_text(json.dumps(saved), encoding="utf-8")

    text = sf.replay_saved(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "slice" not in line]
    assert len(rows) == 16  # 3 checks per slice below capacity, 2 for the burst; twice
    assert all("| within |" in row and "+0.0" in row for row in rows), rows

    refitted = sf.replay_saved(tmp_path, refit_path=True)
    assert (tmp_path / "refitted-profile.yaml").exists()
    assert "refitted profile" in refitted and "burst 16 x 32 tokens" in refitted
