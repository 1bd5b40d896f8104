"""``bench.flow_control --trace``: a real trace replayed beside the generated workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import flow_control
from traces.format import TraceRecord


def _trace(path: Path, requests: int) -> Path:
    with path.open("w") as f:
        for i in range(requests):
            record = {"timestamp": i * 100, "input_length": 600, "output_length": 20,
                      "hash_ids": [0, i + 1]}
            f.write(json.dumps(record) + "\n")
    return path


def test_a_trace_subject_is_named_by_its_file_and_cut_to_the_limit(tmp_path: Path) -> None:
    traces = flow_control.trace_subjects([str(_trace(tmp_path / "conversation.jsonl", 10))], 4)
    assert list(traces) == ["conversation"]
    assert [r.timestamp for r in traces["conversation"]] == [0, 100, 200, 300]


def test_a_trace_subject_spreads_its_arrivals_when_asked(tmp_path: Path) -> None:
    path = str(_trace(tmp_path / "conversation.jsonl", 10))
    spread = flow_control.trace_subjects([path], 4, arrival_spread_ms=100, seed=1)
    stamps = [r.timestamp for r in spread["conversation"]]
    assert len(stamps) == 4 and stamps == sorted(stamps)
    assert all(i * 100 <= t < (i + 1) * 100 for i, t in enumerate(stamps))
    assert stamps != [0, 100, 200, 300]


def test_a_negative_arrival_spread_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(_trace(tmp_path / "conversation.jsonl", 10))
    with pytest.raises(SystemExit) as exited:
        flow_control.main(["--workloads", "", "--trace", trace, "--arrival-spread-ms", "-1"])
    assert exited.value.code == 2
    assert "--arrival-spread-ms" in capsys.readouterr().err


def test_a_missing_trace_is_a_usage_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        flow_control.main(["--workloads", "", "--trace", str(tmp_path / "nope.jsonl")])
    assert exited.value.code == 2
    assert "nope.jsonl" in capsys.readouterr().err


def _records(rows: list[tuple[int, int, int]]) -> list[TraceRecord]:
    """(timestamp ms, prompt tokens, output tokens) -> trace records, each its own conversation."""
    records: list[TraceRecord] = []
    next_id = 0
    for timestamp, prompt, output in rows:
        blocks = -(-prompt // 512)
        records.append(
            TraceRecord(timestamp, prompt, output, tuple(range(next_id, next_id + blocks)))
        )
        next_id += blocks
    return records


def test_a_trace_is_replayed_with_and_without_flow_control_and_served_alone(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "tiny.jsonl"
    rows = _records([(i * 200, 1000, 20) for i in range(40)])  # 40 conversations
    trace.write_text("".join(r.to_json() + "\n" for r in rows))
    page = tmp_path / "fc.md"
    flow_control.main(
        ["--workloads", "", "--scales", "1", "--trace", str(trace), "--out", str(page)]
    )
    text = page.read_text()
    assert "`tiny` (40 requests)" in text
    assert "| tiny | 1× |" in text
    # Each subject served alone, and that ceiling quoted beside the critical criterion.
    assert "## Served alone" in text
    assert "| tiny | 100.0% | 100.0% | 100.0% | 100.0% |" in text
    assert "(served alone: 100.0%)" in text


def test_served_alone_spaces_a_burst_out_so_only_a_requests_own_length_misses() -> None:
    # 300 requests at once overload 8 replicas; one at a time, each meets its SLOs, except
    # the 90k-token prompt, whose prefill alone takes longer than the 2 s TTFT SLO.
    burst = _records([(0, 4000, 200)] * 300 + [(0, 90_000, 10)])
    mix = "critical=0.2,standard=0.5,sheddable=0.3"
    at_once = flow_control.run_point("burst", burst, 1.0, mix, flow_control.FlowControlSettings())
    alone = flow_control.served_alone(burst, mix)
    assert at_once.off.goodput is not None and at_once.off.goodput < 0.9
    assert alone.goodput == pytest.approx(300 / 301)


def test_the_seed_reaches_every_simulation_of_a_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real = flow_control.simulate

    def spy(requests, policies, config, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(config.seed)
        return real(requests, policies, config, **kwargs)

    monkeypatch.setattr(flow_control, "simulate", spy)
    trace = _records([(i * 200, 1000, 20) for i in range(10)])
    mix, settings = "critical=0.5,standard=0.5", flow_control.FlowControlSettings()
    flow_control.run_point("t", trace, 1.0, mix, settings, seed=7)
    flow_control.served_alone(trace, mix, seed=7)
    assert seen == [7, 7, 7]
    assert flow_control._parser().parse_args(["--seed", "3"]).seed == [3]


def test_several_seeds_replay_everything_once_each_and_print_their_mean_without_a_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "tiny.jsonl"
    rows = _records([(i * 200, 1000, 20) for i in range(40)])
    trace.write_text("".join(r.to_json() + "\n" for r in rows))
    page = tmp_path / "fc.md"
    args = ["--workloads", "", "--scales", "1", "--trace", str(trace), "--out", str(page)]
    assert flow_control.main([*args, "--seed", "0,1", "--jobs", "1"]) == 0
    out = capsys.readouterr()
    assert "seed 0  PASS  tiny" in out.out and "seed 1  PASS  tiny" in out.out
    assert "seed 0: 3 of 3 checks pass; overall goodput with flow control 100.00%" in out.out
    assert "seed 1: 3 of 3 checks pass" in out.out
    assert "mean of 2 seeds: 3.0 checks pass" in out.out
    assert "no page written" in out.err
    assert not page.exists()


@pytest.mark.parametrize("seeds", ["0,x", "1,1", ""])
def test_seeds_that_are_not_distinct_integers_are_a_usage_error(
    seeds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        flow_control._parser().parse_args(["--seed", seeds])
    assert exited.value.code == 2
    assert "--seed" in capsys.readouterr().err


def test_an_unknown_workload_is_a_usage_error_naming_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A typo once replayed nothing and reported "0 of 0 checks pass" with exit status 0.
    with pytest.raises(SystemExit) as exited:
        flow_control.main(["--workloads", "rag,agnet"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unknown subject 'agnet'" in err
    assert "valid: rag, rag-cache-buster, multi-turn, agent, b2b-lora, mooncake-like" in err


@pytest.mark.parametrize("workloads", ["none", "", "rag,agent"])
def test_none_or_known_workloads_are_accepted(workloads: str) -> None:
    args = flow_control._parser().parse_args(["--workloads", workloads])
    assert args.workloads == ([] if workloads in ("none", "") else ["rag", "agent"])


def test_nothing_to_replay_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        flow_control.main(["--workloads", "none"])
    assert exited.value.code == 2
    assert "nothing to replay" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "flag"),
    [
        (["--requests", "0"], "--requests"),
        (["--trace-requests", "0"], "--trace-requests"),
        (["--scales", "1,x"], "--scales"),
        (["--scales", "0,1"], "--scales"),
        (["--scales", "nan"], "--scales"),
    ],
)
def test_counts_and_scales_out_of_range_are_usage_errors_not_tracebacks(
    given: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        flow_control.main([*given, "--no-page"])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_check_over_no_request_of_its_class_reads_na_not_fail() -> None:
    # 10 requests, all standard: no critical goodput to judge (it was "FAIL nan%").
    trace = _records([(i * 200, 1000, 20) for i in range(10)])
    settings = flow_control.FlowControlSettings()
    point = flow_control.run_point("t", trace, 2.0, "standard=1", settings)
    checks = {c.name: c for c in flow_control.check(point)}
    critical = checks["critical >= 95%"]
    assert critical.passed is None and critical.verdict == "n/a"
    assert critical.detail == "no critical request"
    assert checks["standard on > off"].passed is not None
    table = flow_control.checks_table(list(checks.values()))
    assert "| t | 2× | critical >= 95% | n/a | no critical request |" in table
    page = flow_control.render_page(
        [point], list(checks.values()), "cmd", settings, 10, [], Path("fc.md"), 1.0
    )
    assert page.startswith("# Flow control: goodput by class with and without it, 2× of")
    judged = len(checks) - 1
    passed = sum(c.passed is True for c in checks.values())
    assert f"**Checks: {passed} of {judged} pass (1 n/a: no request of their class).**" in page
