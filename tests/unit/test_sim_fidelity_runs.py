"""bench.sim_fidelity's measurement: the per-request median of the real runs, and the noise
floor (the run farthest from it)."""

from __future__ import annotations

import pytest

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
