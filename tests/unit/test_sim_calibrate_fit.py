"""The step-time model, its least-squares fit, and profile files that carry it."""

from __future__ import annotations

from pathlib import Path

import pytest

from planning.calibrate.fit import Observation, fit_step_time
from planning.calibrate.probe import HistogramTotals, TimedCompletion
from planning.calibrate.workload import _decode_batch, _engine_span, _Prompts, _whole_batch_window
from replica.sim.engine import EngineConfig, EngineModel, SimRequest
from replica.sim.profiles import ProfileError, load_preset
from replica.sim.step_time import StepTimeModel

TRUE = StepTimeModel(
    base_s=0.02, prefill_token_s=1e-4, decode_seq_s=2e-3, context_token_s=5e-6,
    request_overhead_s=3e-3,
)


def _designed() -> list[Observation]:
    """Exact observations of ``TRUE`` for the kinds of step calibration measures."""
    observations = []
    for length, cached in [(32, 0), (32, 16), (512, 0), (512, 496), (1024, 0), (1024, 1008)]:
        ttft = TRUE.request_overhead_s + TRUE.step_s(length - cached, 0, cached)
        observations.append(
            Observation("prefill", f"p{length}", ttft, prefill_tokens=length - cached,
                        context_tokens=cached)
        )
    tokens = 32
    for batch in (1, 2, 4, 8):
        for context in (32, 256):
            # B prompts prefilled in one step, then N - 1 decode steps over a growing context.
            e2e = TRUE.request_overhead_s + TRUE.step_s(batch * context, 0, 0) + sum(
                TRUE.step_s(0, batch, batch * (context + k - 1)) for k in range(1, tokens)
            )
            observations.append(
                Observation("decode", f"d{batch}x{context}", e2e, steps=tokens,
                            prefill_tokens=batch * context, decode_seqs=(tokens - 1) * batch,
                            context_tokens=(tokens - 1) * batch * (context + (tokens - 2) / 2))
            )
    return observations


def test_fit_recovers_exact_parameters() -> None:
    result = fit_step_time(_designed())
    for name, value in TRUE.as_mapping().items():
        assert getattr(result.model, name) == pytest.approx(value, rel=1e-6), name
    assert result.max_abs_error < 1e-6
    assert "median |error|" in result.table()


def test_fit_fixes_an_unsupported_coefficient_at_zero() -> None:
    # An engine whose decode gets *cheaper* with context would fit a negative coefficient.
    observations = [
        Observation("prefill", "p", 0.01 + 1e-5 * n, prefill_tokens=n) for n in (10, 100, 1000)
    ] + [
        Observation("decode", "d", 0.01 + 1e-3 * b - 1e-7 * b * c, decode_seqs=b,
                    context_tokens=b * c, overheads=0)
        for b in (1, 4, 8)
        for c in (100, 1000)
    ]
    model = fit_step_time(observations).model
    assert model.context_token_s == 0.0
    assert all(v >= 0 for v in model.as_mapping().values())


def test_fit_needs_both_kinds_of_observation() -> None:
    with pytest.raises(ValueError, match="prefill and decode"):
        fit_step_time([Observation("prefill", "p", 0.01, prefill_tokens=10)])


def test_step_time_rejects_bad_mappings() -> None:
    with pytest.raises(ValueError, match=r"step_time\.nope: unknown key"):
        StepTimeModel.from_mapping({"base_s": 1, "prefill_token_s": 0, "decode_seq_s": 0,
                                    "nope": 1})
    with pytest.raises(ValueError, match=r"step_time\.decode_seq_s: required"):
        StepTimeModel.from_mapping({"base_s": 1, "prefill_token_s": 0})
    with pytest.raises(ValueError, match=r"step_time\.base_s: must be a number >= 0"):
        StepTimeModel(base_s=-1, prefill_token_s=0, decode_seq_s=0)


def test_engine_times_steps_with_a_measured_model() -> None:
    config = EngineConfig.from_profile("tiny", step_time=TRUE.as_mapping())
    engine = EngineModel(config)
    engine.submit(SimRequest("a", list(range(100, 200)), max_tokens=3))
    prefill = engine.step(0.0)
    assert prefill.duration_s == pytest.approx(TRUE.step_s(100, 0, 0))
    decode = engine.step(prefill.duration_s)
    # The decode computes the first output token over the 100 prompt tokens.
    assert decode.duration_s == pytest.approx(TRUE.step_s(0, 1, 100))


def test_profile_file_is_a_preset(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "hardware: l4\nmodel: tiny\nnum_gpu_blocks_override: 64\nstep_time:\n"
        "  base_s: 0.01\n  prefill_token_s: 0.0001\n  decode_seq_s: 0.001\n"
        "calibration:\n  engine: http://x\n",
        encoding="utf-8",
    )
    config = EngineConfig.from_profile(str(path))
    assert config.num_gpu_blocks == 64
    assert config.step_time == StepTimeModel(0.01, 0.0001, 0.001)
    # Named otherwise (`sim calibrate --output cpu.profile`), it is still a file, not a preset.
    other = tmp_path / "cpu.profile"
    other.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    assert EngineConfig.from_profile(str(other)).num_gpu_blocks == 64


def test_profile_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"missing\.yaml"):
        load_preset(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\n", encoding="utf-8")
    with pytest.raises(ProfileError, match=r"bad\.yaml: hardware: required"):
        load_preset(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("hardware: l4\nmodel: tiny\nwarp_drive: 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown setting 'warp_drive'"):
        EngineConfig.from_profile(str(unknown))


def test_plan_capacity_uses_a_calibrated_prefill_time(tmp_path: Path) -> None:
    from planning.capacity import engine_model

    path = tmp_path / "cal.yaml"
    path.write_text(
        "hardware: l4\nmodel: tiny\nstep_time:\n  base_s: 0.01\n  prefill_token_s: 0.0001\n"
        "  decode_seq_s: 0.001\n",
        encoding="utf-8",
    )
    model = engine_model(str(path))
    assert model.prefill_ms(1000) == pytest.approx(10.0 + 100.0)
    assert "measured step time" in model.describe


def test_repeats_are_combined_by_their_median() -> None:
    # One repeat stalled (another process had the CPU): the median ignores it.
    stalled = [Observation("decode", "d", t, decode_seqs=3, context_tokens=300, overheads=0)
               for t in (0.010, 0.011, 0.050)]
    observations = _designed() + stalled
    result = fit_step_time(observations)
    labels = [r.observation.label for r in result.residuals]
    assert "d (median of 3)" in labels
    combined = next(r for r in result.residuals if r.observation.label == "d (median of 3)")
    assert combined.observation.measured_s == pytest.approx(0.011)


def test_calibrate_command_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    from fleetgate.cli import main as fleetgate

    assert fleetgate(["sim", "calibrate"]) == 2
    assert "--engine URL is required" in capsys.readouterr().err
    # Port 1 on loopback refuses connections: a clear error, no traceback.
    assert fleetgate(["sim", "calibrate", "--engine", "http://127.0.0.1:1"]) == 1
    assert "cannot reach the engine at http://127.0.0.1:1" in capsys.readouterr().err
    # Mistakes in what to write are found before measuring (the CLI review: after minutes).
    engine = ["sim", "calibrate", "--engine", "http://127.0.0.1:1"]
    assert fleetgate([*engine, "--base-profile", "nope"]) == 2
    assert "--base-profile: presets.yaml: unknown preset 'nope'" in capsys.readouterr().err
    assert fleetgate([*engine, "--output", "/nonexistent-dir/p.yaml"]) == 2
    assert "no such folder /nonexistent-dir" in capsys.readouterr().err


def test_plan_fits_the_engine_limits() -> None:
    from planning.calibrate.workload import CalibrationPlan

    plan = CalibrationPlan(prefill_lengths=(32, 4000), decode_contexts=(32, 512),
                           decode_batches=(1, 8), decode_tokens=16).fitted_to(2048, 2048)
    # Prompts fit one step and the model's context (2048 - 16 output - 1).
    assert plan.prefill_lengths == (32, 2031)
    # Batch 8 stays (8 x 32 fits a step); only 8 x 512 is skipped, by the workload.
    assert plan.decode_batches == (1, 8)
    assert plan.max_batch_tokens == 2048


def test_plan_decodes_the_engines_full_batch_and_nothing_larger() -> None:
    from planning.calibrate.workload import CalibrationPlan

    plan = CalibrationPlan(decode_batches=(1, 2, 4, 8))
    # A saturated engine runs max_num_seqs at once: that batch is measured, not extrapolated.
    assert plan.fitted_to(2048, 2048, max_num_seqs=16).decode_batches == (1, 2, 4, 8, 16)
    # A smaller limit caps the plan's batches (8 would run as 6, then 2).
    assert plan.fitted_to(2048, 2048, max_num_seqs=6).decode_batches == (1, 2, 4, 6)
    # Unknown limit: the plan as given.
    assert plan.fitted_to(2048, 2048).decode_batches == (1, 2, 4, 8)


def test_decode_span_comes_from_the_engines_clock_only_when_it_counted_exactly_the_batch() -> None:
    before = HistogramTotals(total_s=10.0, count=100)
    # 4 requests x 31 decode steps = 124 gaps, 6.2 s in all: 50 ms a gap, 31 gaps a request.
    after = HistogramTotals(total_s=16.2, count=224)
    assert _engine_span(before, after, batch=4, steps=31) == pytest.approx(31 * 0.05)
    # No histogram on the engine, or one that moved by someone else's tokens too: the client's
    # view is used instead (None here).
    assert _engine_span(None, after, batch=4, steps=31) is None
    assert _engine_span(before, None, batch=4, steps=31) is None
    assert _engine_span(before, HistogramTotals(17.0, 240), batch=4, steps=31) is None
    assert _engine_span(before, HistogramTotals(10.0, 224), batch=4, steps=31) is None


class _MergingEngine:
    """An engine client whose streams arrive in ``chunks`` chunks over ``span_s`` (the API
    server merged the rest), while its histogram counted ``gap_s`` per token gap."""

    def __init__(self, chunks: int, span_s: float, gap_s: float) -> None:
        self.chunks, self.span_s, self.gap_s = chunks, span_s, gap_s
        self.totals = (0.0, 0.0)

    async def itl_totals(self) -> HistogramTotals:
        return HistogramTotals(*self.totals)

    async def complete(self, model: str, prompt: list[int], max_tokens: int) -> TimedCompletion:
        total, count = self.totals
        self.totals = (total + self.gap_s * (max_tokens - 1), count + max_tokens - 1)
        times = [1.0 + self.span_s * i / max(1, self.chunks - 1) for i in range(self.chunks)]
        return TimedCompletion(0.9, times, max_tokens)


@pytest.mark.parametrize(
    ("chunks", "span_s", "expected_s", "clock"),
    [
        (32, 31 * 0.05, 31 * 0.05, "client"),  # the client kept up: its own stretch
        (2, 0.31, 31 * 0.05, "engine clock"),  # merged into two chunks
        (32, 0.003, 31 * 0.05, "engine clock"),  # every chunk in one burst at the end
    ],
)
async def test_a_stream_the_api_server_fell_behind_on_is_timed_by_the_engines_clock(
    chunks: int, span_s: float, expected_s: float, clock: str
) -> None:
    engine = _MergingEngine(chunks=chunks, span_s=span_s, gap_s=0.05)
    observation = await _decode_batch(engine, "m", _Prompts(0), 32, 4, 32)  # type: ignore[arg-type]
    assert observation is not None
    assert observation.measured_s == pytest.approx(expected_s)
    assert observation.clock == clock


async def test_a_merged_stream_without_the_engines_histogram_is_no_observation() -> None:
    engine = _MergingEngine(chunks=2, span_s=0.31, gap_s=0.05)
    engine.itl_totals = _no_histogram  # type: ignore[method-assign]
    assert await _decode_batch(engine, "m", _Prompts(0), 32, 4, 32) is None  # type: ignore[arg-type]


async def _no_histogram() -> None:
    return None


def test_a_batch_admitted_in_two_steps_is_timed_over_the_steps_all_of_it_decoded() -> None:
    # Two requests admitted at once; two more a step later, whose 0.5 s prefill step the first
    # two also wait out. Then 50 ms decode steps; 32 tokens each, one chunk per token.
    early = [1.0] + [1.5 + 0.05 * k for k in range(31)]
    late = [1.5 + 0.05 * k for k in range(32)]
    timed = [TimedCompletion(0.9, times, 32) for times in (early, early, late, late)]
    span, steps = _whole_batch_window(timed)  # type: ignore[misc]
    # From the late pair's first token to the early pair's last: 30 steps of the whole batch
    # (the median request's span would give 31 steps in 1.775 s, 15% slow per step).
    assert steps == 30
    assert span == pytest.approx(30 * 0.05)
