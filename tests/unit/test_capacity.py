"""Capacity planning: replica search, hockey stick, cost, roofline wiring and the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from planning import capacity
from planning.capacity import (
    CapacityError,
    hockey_stick,
    operating_point,
    replicas_needed,
    ttft_percentile_ms,
)
from planning.erlang import wait_percentile


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    argv = ["--rate", "20", "--slo-ttft-ms", "800", "--prompt-tokens", "4000"]
    argv += ["--output-tokens", "250", "--prefill-ms", "100"]
    args = parser.parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(
    ("rate", "slo_ms", "prefill_ms"),
    [(1.0, 500.0, 100.0), (20.0, 800.0, 100.0), (20.0, 150.0, 100.0), (300.0, 400.0, 60.0)],
)
def test_replicas_needed_is_the_smallest_fleet_that_meets_the_slo(
    rate: float, slo_ms: float, prefill_ms: float
) -> None:
    replicas = replicas_needed(rate, slo_ms, prefill_ms, 0.95)
    assert ttft_percentile_ms(replicas, rate, prefill_ms, 0.95) <= slo_ms
    # One fewer replica either misses the SLO or cannot keep up at all.
    if replicas > 1:
        assert ttft_percentile_ms(replicas - 1, rate, prefill_ms, 0.95) > slo_ms


def test_ttft_is_wait_percentile_plus_prefill() -> None:
    expected = wait_percentile(4, 30.0, 10.0, 0.95) * 1000 + 100.0
    assert ttft_percentile_ms(4, 30.0, 100.0, 0.95) == pytest.approx(expected)


def test_a_tighter_slo_or_more_traffic_never_needs_fewer_replicas() -> None:
    counts = [replicas_needed(rate, 300.0, 50.0, 0.95) for rate in (5, 10, 20, 40, 80)]
    assert counts == sorted(counts)
    counts = [replicas_needed(40.0, slo, 50.0, 0.95) for slo in (1000, 300, 120, 60)]
    assert counts == sorted(counts)


def test_an_slo_below_the_prefill_time_is_impossible_and_says_why() -> None:
    with pytest.raises(CapacityError, match=r"prefill alone takes 900\.0 ms"):
        replicas_needed(1.0, 800.0, 900.0, 0.95)


def test_hockey_stick_rises_with_utilisation() -> None:
    points = hockey_stick(4, 100.0, 0.95)
    assert [p.utilisation for p in points] == pytest.approx(list(capacity.HOCKEY_STICK_UTILISATION))
    ttft = [p.ttft_ms for p in points]
    assert ttft == sorted(ttft)
    # The knee: the last step (97% -> 99%) adds more than the whole first half of the curve.
    assert ttft[-1] - ttft[-2] > ttft[len(ttft) // 2] - ttft[0]


def test_operating_point_utilisation_is_offered_load_per_replica() -> None:
    point = operating_point(5, 20.0, 100.0, 0.95)
    assert point.utilisation == pytest.approx(20.0 * 0.1 / 5)


@pytest.mark.parametrize(
    ("price", "prompt", "output"), [(3.0, 4000, 250), (1.8, 1000, 1000), (0.0, 100, 0)]
)
def test_cost_per_million_tokens(price: float, prompt: int, output: int) -> None:
    plan = capacity.plan_capacity(
        _args(price_per_hour=price, prompt_tokens=prompt, output_tokens=output)
    )
    fleet = plan.sized.replicas * price
    assert plan.fleet_cost_per_hour == pytest.approx(fleet)
    tokens_per_hour = 20.0 * 3600 * (prompt + output)
    assert plan.cost_per_million_tokens == pytest.approx(fleet / tokens_per_hour * 1e6)


def test_no_price_means_no_cost_figures() -> None:
    plan = capacity.plan_capacity(_args())
    assert plan.fleet_cost_per_hour is None
    assert plan.cost_per_million_tokens is None
    assert "pass --price-per-hour" in capacity.render_text(plan)


def test_roofline_prefill_time_scales_with_uncached_tokens() -> None:
    cold = capacity.plan_capacity(_args(prefill_ms=None, profile="h100-llama3-8b"))
    warm = capacity.plan_capacity(
        _args(prefill_ms=None, profile="h100-llama3-8b", cached_fraction=0.75)
    )
    assert warm.uncached_tokens == pytest.approx(1000)
    assert warm.prefill_ms == pytest.approx(
        capacity.engine_model("h100-llama3-8b").prefill_ms(1000)
    )
    assert warm.prefill_ms < cold.prefill_ms
    assert warm.sized.replicas <= cold.sized.replicas
    assert "roofline" in warm.service_time_source
    assert warm.price_per_hour is not None and warm.price_per_hour > 0


def test_a_calibrated_profile_counts_the_request_path_and_the_prefill_chunks(
    tmp_path: Path,
) -> None:
    """The planning review: with a calibrated profile, `plan capacity` took one prefill step and
    no request overhead (410 ms for an 8,000-token prompt), and passed a 500 ms SLO that the
    simulator, with the same profile, served a lone request in 591 ms."""
    profile = tmp_path / "calibrated.yaml"
    profile.write_text(
        "hardware: h100-sxm\nmodel: llama3-8b\nmax_num_batched_tokens: 2048\n"
        "step_time: {base_s: 0.010, prefill_token_s: 0.00005, decode_seq_s: 0.0002, "
        "context_token_s: 0.0000001, request_overhead_s: 0.150}\n"
    )
    plan = capacity.plan_capacity(
        _args(prefill_ms=None, profile=str(profile), prompt_tokens=8000, slo_ttft_ms=1000.0)
    )
    # 4 chunks (2048, 2048, 2048, 1856) of 10 ms each + 8,000 x 0.05 ms, each reading the KV
    # before it: (0 + 2048 + 4096 + 6144) x 0.0001 ms: the replica's work. The 150 ms request
    # path is in the TTFT, not in the work (the diff review: counted as work, it sized 9
    # replicas where the simulator met the SLO with 3).
    assert plan.prefill_ms == pytest.approx(4 * 10 + 400 + 12288 * 0.0001)
    assert plan.overhead_ms == pytest.approx(150)
    assert plan.sized.ttft_ms >= plan.prefill_ms + 150
    busy = capacity.plan_capacity(
        _args(prefill_ms=None, profile=str(profile), prompt_tokens=8000, slo_ttft_ms=1000.0,
              rate=10.0)
    )
    # 10 req/s of 441 ms of work is 4.4 replicas busy: 150 ms more each would be 5.9.
    assert busy.to_dict()["service"]["offered_load_erlangs"] == pytest.approx(10 * 0.4412288)
    with pytest.raises(capacity.CapacityError, match=r"prefill alone takes 591\.2 ms"):
        capacity.plan_capacity(
            _args(prefill_ms=None, profile=str(profile), prompt_tokens=8000, slo_ttft_ms=500.0)
        )


def test_explicit_prefill_overrides_the_profile_but_keeps_its_price() -> None:
    plan = capacity.plan_capacity(_args(profile="h100-llama3-8b"))
    assert plan.prefill_ms == 100.0
    assert plan.price_per_hour == capacity.engine_model("h100-llama3-8b").price_per_hour


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rate": 0.0}, "--rate must be a number > 0"),
        ({"slo_ttft_ms": -5.0}, "--slo-ttft-ms must be a number > 0"),
        ({"prompt_tokens": 0}, "--prompt-tokens must be >= 1"),
        ({"output_tokens": -1}, "--output-tokens must be >= 0"),
        ({"cached_fraction": 1.0}, r"--cached-fraction must be in \[0, 1\)"),
        ({"quantile": 95.0}, r"--quantile must be in \(0, 1\)"),
        ({"prefill_ms": 0.0}, "--prefill-ms must be a number > 0"),
        ({"price_per_hour": -1.0}, "--price-per-hour must be a number >= 0"),
        # Infinite: passed the range checks (the CLI review: "Infinity" in the JSON).
        ({"price_per_hour": float("inf")}, "--price-per-hour must be a number >= 0"),
        ({"slo_ttft_ms": float("inf")}, "--slo-ttft-ms must be a number > 0"),
        ({"prefill_ms": None}, "give --profile PRESET"),
        ({"prefill_ms": None, "profile": "no-such-gpu"}, "--profile no-such-gpu: .*unknown"),
        ({"rate": float("inf")}, "--rate must be a number > 0"),
        ({"rate": 1e9}, "replicas busy on average, over the 100,000 this sizes"),
    ],
)
def test_bad_questions_are_refused_clearly(overrides: dict, message: str) -> None:
    with pytest.raises(CapacityError, match=message):
        capacity.plan_capacity(_args(**overrides))


def test_cli_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rate", "12", "--slo-ttft-ms", "500", "--prompt-tokens", "2000"]
    argv += ["--output-tokens", "200", "--prefill-ms", "80", "--price-per-hour", "2", "--json"]
    assert capacity.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    replicas = out["sized"]["replicas"]
    assert replicas == replicas_needed(12.0, 500.0, 80.0, 0.95)
    assert out["cost"]["fleet_per_hour"] == pytest.approx(2.0 * replicas)
    assert len(out["hockey_stick"]) == len(capacity.HOCKEY_STICK_UTILISATION)
    assert out["approximations"] == list(capacity.APPROXIMATIONS)


def test_cli_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rate", "1", "--slo-ttft-ms", "50", "--prompt-tokens", "10"]
    argv += ["--output-tokens", "1", "--prefill-ms", "80"]
    assert capacity.main(argv) == 2
    assert "no number of replicas helps" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path) -> None:
    out = tmp_path / "ttft.png"
    plan = capacity.plan_capacity(_args())
    capacity.plot_hockey_stick(plan, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_output_states_the_approximations() -> None:
    text = capacity.render_text(capacity.plan_capacity(_args(price_per_hour=3.0)))
    assert "approximations" in text
    # Each caveat is printed (wrapped; its first words stay on one line).
    assert all(caveat[:40] in text for caveat in capacity.APPROXIMATIONS)


@pytest.mark.parametrize(
    ("name", "message"),
    [("x.foo", "format 'foo' is not supported"), ("missing/x.png", "no such folder")],
)
def test_bad_plot_path_is_one_line_exit_2_before_any_output(
    tmp_path, capsys: pytest.CaptureFixture[str], name: str, message: str
) -> None:
    argv = ["--rate", "20", "--slo-ttft-ms", "800", "--prompt-tokens", "4000"]
    argv += ["--output-tokens", "250", "--prefill-ms", "100", "--plot", str(tmp_path / name)]
    assert capacity.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
