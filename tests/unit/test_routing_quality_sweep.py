"""The load-sweep benchmark's logic on synthetic results: aggregation, checks, search, page."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from bench import routing_quality as rq
from planning.simulator import SimulationConfig, SimulationReport, TraceRequest
from planning.simulator.api import SweepPoint
from planning.simulator.ceilings import Ceilings
from planning.simulator.summary import PolicySummary, Spread
from traces.format import TraceRecord
from traces.spread import spread_arrivals


def _summary(policy: str, goodput: float, ttft_p95: float, hit: float) -> PolicySummary:
    return PolicySummary(
        policy,
        100,
        hit,
        ttft_p95_ms=ttft_p95,
        goodput=goodput,
        queue_p95_ms=ttft_p95 / 2,
    )


def _point(
    scale: float, rows: Sequence[PolicySummary], pooled: float = 0.8, seed: int = 0
) -> SweepPoint:
    return SweepPoint(
        scale, seed, 100, 100.0 * scale, SimulationReport(list(rows), Ceilings(0.8, pooled, 1000))
    )


def _level(scale: float, rows: Sequence[PolicySummary], pooled: float = 0.8) -> rq.LoadLevel:
    return rq.load_level("w", [_point(scale, rows, pooled)])


def _checks(verdict: rq.Verdict | None) -> dict[str, bool | None]:
    assert verdict is not None
    return {check.name: check.passed for check in verdict.checks}


GOOD = [
    _summary("round-robin", 0.60, 900.0, 0.50),
    _summary("cache-aware", 0.70, 800.0, 0.75),
    _summary("mine", 0.80, 700.0, 0.78),
]


def test_a_clear_winner_passes_every_check() -> None:
    assert _checks(rq.evaluate(_level(2.0, GOOD), "mine")) == dict.fromkeys(rq.CHECK_NAMES, True)


def test_each_check_can_fail_on_its_own() -> None:
    slower = [*GOOD[:2], _summary("mine", 0.80, 801.0, 0.78)]
    assert _checks(rq.evaluate(_level(1.0, slower), "mine"))["p95 TTFT"] is False
    cold = [*GOOD[:2], _summary("mine", 0.80, 700.0, 0.71)]  # 0.71 < 0.9 x 0.8
    assert _checks(rq.evaluate(_level(1.0, cold), "mine"))["hit rate"] is False
    worse = [*GOOD[:2], _summary("mine", 0.69, 700.0, 0.78)]
    assert _checks(rq.evaluate(_level(1.0, worse), "mine"))["best goodput"] is False


def test_goodput_ties_within_half_a_point_but_the_margin_needs_three_from_2x() -> None:
    tie = [*GOOD[:2], _summary("mine", 0.696, 700.0, 0.78)]
    at_one = _checks(rq.evaluate(_level(1.0, tie), "mine"))
    assert at_one["best goodput"] is True
    assert at_one["goodput margin"] is None  # below 2x it does not apply
    narrow = [*GOOD[:2], _summary("mine", 0.72, 700.0, 0.78)]  # +2 points
    at_two = _checks(rq.evaluate(_level(2.0, narrow), "mine"))
    assert at_two["best goodput"] is True
    assert at_two["goodput margin"] is False
    verdict = rq.evaluate(_level(2.0, narrow), "mine")
    assert verdict is not None and [c.name for c in verdict.failed] == ["goodput margin"]


def test_nothing_to_hit_passes_the_hit_rate_check() -> None:
    rows = [_summary("round-robin", 1.0, 300.0, 0.0), _summary("mine", 1.0, 250.0, 0.0)]
    verdict = rq.evaluate(_level(0.5, rows, pooled=0.0), "mine")
    assert _checks(verdict)["hit rate"] is True
    assert verdict is not None and "n/a" in verdict.checks[2].detail


def test_a_missing_figure_fails_instead_of_passing() -> None:
    rows = [*GOOD[:2], _summary("mine", math.nan, math.nan, 0.78)]
    checks = _checks(rq.evaluate(_level(3.0, rows), "mine"))
    assert checks["best goodput"] is False
    assert checks["p95 TTFT"] is False
    assert checks["goodput margin"] is False


def test_no_verdict_without_the_default_or_without_a_baseline() -> None:
    assert rq.evaluate(_level(1.0, GOOD[:2]), "mine") is None
    assert rq.evaluate(_level(1.0, GOOD[2:]), "mine") is None


def test_seeds_are_averaged_and_their_range_kept() -> None:
    points = [
        _point(1.0, [_summary("a", 0.5, 100.0, 0.2)], pooled=0.4, seed=0),
        _point(1.0, [_summary("a", 0.7, 300.0, 0.4)], pooled=0.6, seed=1),
    ]
    level = rq.load_level("w", points)
    row = level.get("a")
    assert row is not None
    assert row.goodput == Spread(pytest.approx(0.6), 0.5, 0.7, 2)
    assert row.ttft_p95_ms.mean == pytest.approx(200.0)
    assert level.pooled.mean == pytest.approx(0.5)
    assert level.seeds == (0, 1)
    assert level.get("b") is None


def test_spread_ignores_missing_values() -> None:
    assert Spread.of([1.0, None, math.nan, 3.0]) == Spread(2.0, 1.0, 3.0, 2)
    assert Spread.of([None]).count == 0


def test_seeds_only_at_the_spread_levels() -> None:
    assert rq.seeds_at(3.0, (1.0, 3.0), 3) == (0, 1, 2)
    assert rq.seeds_at(2.0, (1.0, 3.0), 3) == (0,)


def test_the_bracket_doubles_or_halves_towards_the_crossing() -> None:
    assert rq._bracket(lambda factor: factor > 3.0, 8) == (2.0, 4.0)
    assert rq._bracket(lambda factor: factor > 0.3, 8) == (0.25, 0.5)
    with pytest.raises(ValueError, match="never crossed"):
        rq._bracket(lambda factor: False, 3)


def _results() -> list[rq.PointResult]:
    # At 2x the default ("mine") ties on goodput: the margin check must fail on the page.
    rows_two = [_summary("round-robin", 0.50, 900.0, 0.50), _summary("mine", 0.51, 700.0, 0.78)]
    return [
        rq.PointResult("w", _point(1.0, GOOD, seed=0), {}, 1.0, 1.0),
        rq.PointResult("w", _point(1.0, GOOD, seed=1), {}, 1.0, 1.0),
        rq.PointResult("w", _point(2.0, rows_two), {}, 1.0, 1.0),
    ]


def test_the_page_shows_the_command_the_sweep_and_the_failures() -> None:
    results = _results()
    verdicts = [v for lv in rq.load_levels(results) if (v := rq.evaluate(lv, "mine"))]
    subject = rq.Subject("w", "a workload", {0: (), 1: ()}, 100.0, 100.0, "the saturation rate")
    ctx = rq.PageContext(
        ".venv/bin/python -m bench.routing_quality --workloads w",
        12.0,
        3.0,
        1,
        100,
        SimulationConfig(),
        "rq",
        (1.0, 2.0),
        (1.0,),
        2,
        "mine",
    )
    page = rq.render_markdown([subject], results, verdicts, ctx)
    assert ".venv/bin/python -m bench.routing_quality --workloads w" in page
    assert "**FAIL**: +1.0 points vs round-robin" in page
    assert "| **mine** (default) | 80.0% (80.0–80.0) | 51.0% |" in page
    assert "![goodput vs load, w](rq/w-goodput_vs_load.png)" in page
    assert "6 of 7 checks pass; 1 fail" in page
    assert "Refused by the engines" not in page
    # Requests the engines refuse are named on the page, not only in the progress lines.
    refusing = [replace(results[0], rejected={"mine": 2, "round-robin": 2}), *results[1:]]
    page = rq.render_markdown([subject], refusing, verdicts, ctx)
    assert "Refused by the engines" in page and "w 2 request(s) per point" in page
    text = rq.checks_text(verdicts)
    assert "w 2x:" in text and "goodput margin FAIL" in text
    assert text.endswith("checks: 6 of 7 passed, 1 failed")


def test_generated_subjects_scale_from_the_saturation_rate() -> None:
    workload = rq.Workload("rag", 140.0, "rag")
    subject = rq.generated_subject(workload, 5, [0, 1])
    assert sorted(subject.traces) == [0, 1]
    assert subject.traces[0] != subject.traces[1]
    assert subject.factor(2.0) == pytest.approx(2.0)
    measured = rq.replace(subject, reference_rate=70.0)
    assert measured.factor(2.0) == pytest.approx(1.0)


def test_the_search_bisects_to_where_the_queue_passes_one_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fake fleet whose p95 queue is 400 ms per unit of rate scale: it saturates at 2.5x.
    def fake_simulate(
        requests: Sequence[TraceRequest], policies: Sequence[str], config: SimulationConfig
    ) -> SimulationReport:
        factor = 1.0 / requests[-1].arrival_s
        assert list(policies) == [rq.SATURATION_POLICY]
        row = PolicySummary(rq.SATURATION_POLICY, 2, 0.0, queue_p95_ms=400.0 * factor)
        return SimulationReport([row], Ceilings(0.0, 0.0, 0))

    monkeypatch.setattr(rq, "simulate", fake_simulate)
    records = [TraceRecord(0, 512, 4, (1,)), TraceRecord(1000, 512, 4, (2,))]
    search = rq.find_saturation(records, 1.0, SimulationConfig())
    assert search.rate == pytest.approx(2.5, rel=0.025)
    assert [round(p.rate, 3) for p in search.probes[:3]] == [1.0, 2.0, 4.0]
    assert len(search.probes) == 3 + 4  # bracket, then four refinements


def test_a_trace_saturated_at_every_rate_says_its_arrivals_share_timestamps() -> None:
    # Two groups of 12 requests of 8k tokens, each group at one timestamp, on one replica: the
    # group's own prefills queue past a second however slowly the groups follow each other.
    stamps = [0] * 12 + [60_000] * 12
    records = [
        TraceRecord(stamp, 8192, 4, tuple(range(16 * i, 16 * i + 16)))
        for i, stamp in enumerate(stamps)
    ]
    assert rq.largest_arrival_group(records) == 12
    with pytest.raises(ValueError, match="up to 12 at once") as caught:
        rq.find_saturation(records, 1 / 60, SimulationConfig(replicas=1), max_doublings=2)
    assert "drop --find-saturation" in str(caught.value)
    assert "--arrival-spread-ms" in str(caught.value)


def test_spread_arrivals_end_the_groups_that_saturate_every_rate() -> None:
    # The same two groups, spread over a minute each: now a rate exists below saturation.
    stamps = [0] * 12 + [60_000] * 12
    records = [
        TraceRecord(stamp, 8192, 4, tuple(range(16 * i, 16 * i + 16)))
        for i, stamp in enumerate(stamps)
    ]
    spread = spread_arrivals(records, 60_000, seed=0)
    assert rq.largest_arrival_group(spread) == 1
    # Spread, the groups no longer saturate the fleet at the recorded rate: the search finds
    # the rate where they do, above it.
    search = rq.find_saturation(spread, 1 / 60, SimulationConfig(replicas=1), max_doublings=8)
    assert search.rate > 1 / 60


def test_a_trace_subject_draws_one_placement_of_its_arrivals_per_seed(tmp_path) -> None:
    path = tmp_path / "buckets.jsonl"
    path.write_text(
        "".join(TraceRecord(3000 * (i // 5), 500, 20, (i,)).to_json() + "\n" for i in range(40)),
        encoding="utf-8",
    )
    as_recorded = rq.trace_subject(str(path), 512, None, range(2))
    assert as_recorded.traces[0] == as_recorded.traces[1]
    assert rq.largest_arrival_group(as_recorded.traces[0]) == 5
    spread = rq.trace_subject(str(path), 512, None, range(2), arrival_spread_ms=3000)
    assert spread.traces[0] != spread.traces[1]
    assert rq.largest_arrival_group(spread.traces[0]) < 5
    # The load levels still multiply the trace's own rate, whatever the placement.
    assert spread.trace_rate == as_recorded.trace_rate


def test_arrival_spread_is_for_recorded_traces_and_not_negative() -> None:
    with pytest.raises(ValueError, match="needs --trace"):
        rq._plan(rq._parser().parse_args(["--arrival-spread-ms", "3000"]))
    with pytest.raises(ValueError, match=">= 0"):
        rq._plan(rq._parser().parse_args(["--trace", "x.jsonl", "--arrival-spread-ms", "-1"]))


def test_close_latencies_show_the_decimal_that_decides() -> None:
    assert rq._ms(204.3, 204.1) == "204.3 vs 204.1"
    assert rq._ms(204.0, 204.0) == "204 vs 204"
    assert rq._ms(math.inf, 1500.0) == "– vs 1,500"


def test_a_variant_is_reported_but_never_the_baseline() -> None:
    """A ``--variant`` row better than the default does not fail the default's checks."""
    rows = [*GOOD, _summary("mine-stronger", 0.95, 500.0, 0.80)]
    level = _level(2.0, rows)
    assert level.get("mine-stronger") is not None
    assert _checks(rq.evaluate(level, "mine")) == dict.fromkeys(rq.CHECK_NAMES, True)


def test_load_plots_draw_seed_bars_whose_mean_rounds_past_the_range(tmp_path) -> None:
    """Three equal goodputs of 0.1 average to 0.10000000000000002: the bar must still draw."""
    from planning.simulator.report import write_load_plots

    rows = [_summary("round-robin", 0.1, 900.0, 0.5), _summary("mine", 0.1, 700.0, 0.7)]
    points = [_point(3.0, rows, seed=seed) for seed in range(3)]
    assert sum([0.1, 0.1, 0.1]) / 3 > 0.1
    written = write_load_plots(points, tmp_path, "w-")
    assert sorted(p.name for p in written) == [
        "w-goodput_vs_load.png",
        "w-hit_rate_vs_load.png",
        "w-ttft_p95_vs_load.png",
    ]
