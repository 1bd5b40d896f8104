"""Flow control inside ``fleetgate simulate``: classes by conversation, the JSON it adds."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.workloads.generators import generate
from fleetgate.cli import main
from planning.simulator import SimulationConfig, prepare_requests, simulate
from planning.simulator.flow import assign_classes, conversation_keys, parse_class_mix
from routing.flow_control import FlowController, FlowControlSettings, RequestClass
from traces.format import TraceRecord, write_trace


def test_class_mix_parses_and_refuses_bad_specs() -> None:
    mix = parse_class_mix("critical=0.2,standard=0.5,sheddable=0.3")
    assert mix.spec() == "critical=0.2,standard=0.5,sheddable=0.3"
    for bad, message in (
        ("critical=0.2,standard=0.5", "sum to 1"),
        ("urgent=1", "critical, standard, sheddable"),
        ("critical", "CLASS=SHARE"),
        ("critical=x,standard=1", "must be a number"),
        # in the flag's own words, not the enum's repr
        ("critical=2,standard=-1", r"must be in \[0, 1\] \(got critical=2, standard=-1\)"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_class_mix(bad)


def test_every_turn_of_a_conversation_keeps_its_class() -> None:
    # Two conversations and 60 one-off requests behind one shared system prompt (ids 0-1).
    shared = (0, 1)
    records = [TraceRecord(i, 1536, 10, (*shared, 1000 + i)) for i in range(60)]
    for turn in range(1, 4):
        records.append(TraceRecord(100 + turn, 512, 10, (*shared, 100, *range(101, 101 + turn))))
        records.append(TraceRecord(200 + turn, 512, 10, (*shared, 200, *range(201, 201 + turn))))
    keys = conversation_keys(records)
    assert keys[60:] == [100, 200] * 3
    trace = generate("multi-turn", 400, 50.0, seed=0)
    classes = assign_classes(trace, parse_class_mix("critical=0.5,sheddable=0.5"), seed=0)
    by_key: dict[int, set[RequestClass]] = {}
    for key, request_class in zip(conversation_keys(trace), classes, strict=True):
        by_key.setdefault(key, set()).add(request_class)
    assert all(len(found) == 1 for found in by_key.values())
    assert len(by_key) < len(trace)  # conversations, not requests
    counts = Counter(classes)
    assert 0.3 < counts[RequestClass.CRITICAL] / len(trace) < 0.7


def test_simulate_with_classes_reports_flow_control_per_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(generate("multi-turn", 120, 40.0, seed=1), trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "expected-ttft", "--json", "--no-progress"]
    argv += ["--classes", "critical=0.2,standard=0.5,sheddable=0.3", "--rate-scale", "8"]
    assert main(argv) == 0
    on = json.loads(capsys.readouterr().out)[0]
    assert main([*argv, "--flow-control", "off"]) == 0
    off = json.loads(capsys.readouterr().out)[0]
    assert (on["flow_control"], off["flow_control"]) == (True, False)
    assert set(on["goodput_by_class"]) == {"critical", "standard", "sheddable"}
    assert off["shed"] == 0 and off["queued"] == 0 and off["gateway_wait_max_ms"] == 0.0
    # Overloaded 8x on two tiny replicas: flow control holds and sheds, and never sheds critical.
    assert on["queued"] > 0 and on["shed"] > 0
    assert "critical" not in on["shed_by_class"]
    assert on["requests"] + on["shed"] == 120
    assert sum(on["requests_by_class"].values()) == 120  # goodput_by_class's denominators
    overall = sum(
        on["goodput_by_class"][c] * n for c, n in on["requests_by_class"].items()
    ) / sum(on["requests_by_class"].values())
    assert overall == pytest.approx(on["goodput"])  # shed requests are misses in both
    # The table shows the same figures as the JSON, in a second table after the first.
    table_argv = [arg for arg in argv if arg != "--json"]
    assert main(table_argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("goodput by class (refused requests count as misses) and flow control:")
    assert lines[header + 1].split() == [
        "policy", "flow", "control", "critical", "standard", "sheddable", "shed", "queued",
        "steered", "wait", "p95", "max",
    ]  # fmt: skip
    row = lines[header + 2].split()
    assert row[:2] == ["expected-ttft", "on"]
    assert row[2:5] == [
        f"{on['goodput_by_class'][c]:.1%}" for c in ("critical", "standard", "sheddable")
    ]
    assert row[5:8] == [str(on["shed"]), str(on["queued"]), str(on["steered"])]
    assert row[9] == f"{on['gateway_wait_max_ms']:.0f}"
    # Without classes every request is standard, and there is no such table.
    no_classes = [*table_argv[: table_argv.index("--classes")], "--rate-scale", "8"]
    assert main(no_classes) == 0
    assert "goodput by class" not in capsys.readouterr().out
    assert on["flow_control_blind"] is False


def test_flow_control_under_a_policy_with_no_estimate_is_shown_as_admitting_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The simulate review: round-robin's row said flow control "on" at 6x with 0 shed and 0
    queued, beside fleet-cost's hundreds: flow control judges by the policy's TTFT estimate,
    and round-robin gives none, so it admitted everything."""
    trace = tmp_path / "trace.jsonl"
    write_trace(generate("multi-turn", 120, 40.0, seed=1), trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "round-robin,expected-ttft", "--no-progress"]
    argv += ["--classes", "critical=0.2,standard=0.5,sheddable=0.3", "--rate-scale", "8"]
    assert main([*argv, "--json"]) == 0
    rows = {row["policy"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["round-robin"]["flow_control_blind"] is True
    assert rows["round-robin"]["shed"] == 0 and rows["round-robin"]["queued"] == 0
    assert rows["expected-ttft"]["flow_control_blind"] is False
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert any(
        line.split()[:4] == ["round-robin", "on", "(no", "estimate)"] for line in out.splitlines()
    )
    assert "no estimate: the policy predicts no TTFT" in out


def test_the_simulator_reports_each_finished_requests_tpot_to_flow_control(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[float | None, float | None]] = []
    original = FlowController.observe_finished

    def spy(self: FlowController, *args: object) -> None:
        seen.append(args)  # type: ignore[arg-type]
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FlowController, "observe_finished", spy)
    requests = prepare_requests(generate("multi-turn", 80, 40.0, seed=2), rate_scale=4.0)
    config = SimulationConfig(
        profile="tiny",
        replicas=2,
        classes=parse_class_mix("critical=0.5,standard=0.5"),
        flow_control=FlowControlSettings(),
    )
    run = next(iter(simulate(requests, ["expected-ttft"], config).runs.values()))
    # One report per finished request of two tokens or more, every class, with the TPOT the
    # goodput counts (the same arithmetic), against the run's TPOT SLO.
    finished = [o for o in run.outcomes if o.output_tokens >= 2 and o.finish_s == o.finish_s]
    assert len(seen) == len(finished) > 0
    assert {o.request_class for o in finished} == {RequestClass.CRITICAL, RequestClass.STANDARD}
    expected = sorted(
        (o.finish_s - o.first_token_s) * 1000 / (o.output_tokens - 1) for o in finished
    )
    assert sorted(tpot for tpot, _ in seen) == pytest.approx(expected)  # type: ignore[type-var]
    assert {slo for _, slo in seen} == {config.slo_tpot_ms}


def test_simulate_protect_critical_decodes_turns_the_decode_guard_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from routing.flow_control.decode_guard import DecodeGuard

    booked: list[bool] = []
    original = DecodeGuard.admitted

    def spy(self: DecodeGuard, *args: object, **kwargs: object) -> None:
        booked.append(bool(kwargs.get("protect")))
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGuard, "admitted", spy)
    trace = tmp_path / "trace.jsonl"
    write_trace(generate("multi-turn", 60, 40.0, seed=1), trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "expected-ttft", "--json", "--no-progress"]
    argv += ["--classes", "critical=0.5,standard=0.5"]
    assert main(argv) == 0
    assert booked == []  # off by default
    capsys.readouterr()
    assert main([*argv, "--protect-critical-decodes"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["flow_control"] is True
    # Every admission is booked; the critical ones are protected.
    assert len(booked) == 60 and any(booked) and not all(booked)
    assert main([*argv, "--protect-critical-decodes", "--flow-control", "off"]) == 2
    assert "drop --flow-control off" in capsys.readouterr().err


def test_simulate_steers_requests_off_replicas_whose_decodes_run_too_slow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both kinds of steering act in the simulator, each switched off by its own flag:
    critical requests (``--no-steer-critical``) and, on a calm fleet, the others that would
    wait (``--no-steer-when-calm``)."""
    from bench.flow_control import mooncake_like_trace
    from planning.simulator.summary import default_policy

    # Long prompts on 4 replicas at 2x their rate: some replicas' decodes slow past the
    # inter-token bound while others have room.
    trace = tmp_path / "trace.jsonl"
    write_trace(mooncake_like_trace(300), trace)
    argv = ["simulate", "--trace", str(trace), "--replicas", "4", "--rate-scale", "2"]
    argv += ["--policies", default_policy(), "--json", "--no-progress"]
    argv += ["--classes", "critical=0.3,standard=0.4,sheddable=0.3"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out)[0]  # then the unbounded and pooled bounds
    assert (row["policy"], row["flow_control"]) == (default_policy(), True)
    assert row["steered"] > 0  # on by default
    for only_one_kind in ("--no-steer-critical", "--no-steer-when-calm"):
        assert main([*argv, only_one_kind]) == 0
        assert json.loads(capsys.readouterr().out)[0]["steered"] > 0
    steering_off = ["--no-steer-critical", "--no-steer-when-calm", "--no-hold-for-backlog"]
    assert main([*argv, *steering_off]) == 0
    assert json.loads(capsys.readouterr().out)[0]["steered"] == 0
    for flag in steering_off:
        assert main([*argv, flag, "--flow-control", "off"]) == 2
        assert "drop --flow-control off" in capsys.readouterr().err
