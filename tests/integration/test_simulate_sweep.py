"""``fleetgate simulate --rate-scale A,B,…`` (a load sweep) and the benchmark built on it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import routing_quality
from bench._bench_common import NOTES_MARKER
from fleetgate.cli import main
from fleetgate.commands.simulate import default_policies, rate_scales
from planning.simulator import JSON_FIELDS
from routing.policies import registry
from traces.format import TraceRecord, write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _trace(path: Path) -> Path:
    """Two groups of three-block prefixes, six requests 100 ms apart."""
    records = [
        TraceRecord(i * 100, 4 * 512, 4, (group * 10 + 1, group * 10 + 2, group * 10 + 3, 100 + i))
        for i, group in enumerate([0, 1, 0, 1, 0, 1])
    ]
    write_trace(records, path)
    return path


def _simulate(tmp_path: Path, *extra: str) -> list[str]:
    trace = _trace(tmp_path / "trace.jsonl")
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    return [*argv, "--policies", _policies(), "--no-progress", *extra]


def _policies() -> str:
    """A baseline and the gateway's default policy, whatever it is called today."""
    return f"round-robin,{registry.DEFAULT_PROFILE}"


@pytest.mark.parametrize(
    ("text", "scales"),
    [("2", (2.0,)), ("0.5,1,2,3,4", (0.5, 1.0, 2.0, 3.0, 4.0)), ("4, 1", (4.0, 1.0))],
)
def test_rate_scale_takes_one_number_or_a_list(text: str, scales: tuple[float, ...]) -> None:
    assert rate_scales(text) == scales


@pytest.mark.parametrize("text", ["0", "-1", "x", "1,1", "inf", "nan", "", "1,,2"])
def test_rate_scale_refuses_what_is_not_a_list_of_positive_numbers(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        rate_scales(text)


def test_default_policies_end_with_the_default_and_leave_out_random() -> None:
    policies = default_policies().split(",")
    assert policies[-1] == registry.DEFAULT_PROFILE
    assert "random" not in policies
    assert set(policies) == set(registry.BUILTIN_PROFILES) - {"random"}


def test_json_rows_carry_their_rate_scale_and_mark_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_simulate(tmp_path, "--rate-scale", "0.5,2", "--json")) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["rate_scale"], row["policy"]) for row in rows] == [
        (scale, policy)
        for scale in (0.5, 2.0)
        for policy in ("round-robin", registry.DEFAULT_PROFILE, "unbounded", "pooled")
    ]
    for row in rows:
        assert list(row) == list(JSON_FIELDS)
        assert row["default"] is (row["policy"] == registry.DEFAULT_PROFILE)
    assert sum(row["default"] for row in rows) == 2  # one per scale


def test_the_default_flag_follows_the_registry_not_a_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "DEFAULT_PROFILE", "round-robin")
    policies = ["--policies", "round-robin,least-loaded"]
    assert main(_simulate(tmp_path, "--rate-scale", "3", "--json", *policies)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["policy"] for row in rows if row["default"]] == ["round-robin"]
    assert {row["rate_scale"] for row in rows} == {3.0}


def test_the_table_has_one_block_per_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_simulate(tmp_path, "--rate-scale", "1,4")) == 0
    out = capsys.readouterr().out
    assert "(rate scale 1)" in out and "(rate scale 4)" in out
    assert out.count("ceilings (hit rate only):") == 2
    assert f"default policy (fleetgate serve / up): {registry.DEFAULT_PROFILE}" in out


def test_a_sweep_plots_goodput_and_p95_ttft_against_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plots = tmp_path / "plots"
    assert main(_simulate(tmp_path, "--rate-scale", "1,2", "--plot", str(plots))) == 0
    expected = {
        "goodput_vs_load.png",
        "ttft_p95_vs_load.png",
        "hit_rate_vs_load.png",
        "scale-1-ttft_cdf.png",
        "scale-1-hit_rate_goodput.png",
        "scale-2-ttft_cdf.png",
        "scale-2-hit_rate_goodput.png",
    }
    assert {p.name for p in plots.iterdir()} == expected
    for name in expected:
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in capsys.readouterr().err


def test_one_scale_still_writes_only_the_single_run_plots(tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    assert main(_simulate(tmp_path, "--rate-scale", "2", "--plot", str(plots))) == 0
    assert {p.name for p in plots.iterdir()} == {"ttft_cdf.png", "hit_rate_goodput.png"}


def test_the_benchmark_sweeps_a_trace_file_and_writes_its_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "mine.jsonl")
    page = tmp_path / "out" / "page.md"
    argv = ["--trace", str(trace), "--scales", "1,2", "--spread-scales", "2", "--seeds", "2"]
    argv += ["--policies", _policies(), "--replicas", "2", "--jobs", "1"]
    argv += ["--out", str(page)]
    page.parent.mkdir()
    page.write_text(f"an old run\n{NOTES_MARKER}\nhand-written\n", encoding="utf-8")
    assert routing_quality.main(argv) == 0
    text = page.read_text(encoding="utf-8")
    assert "--trace" in text and "the trace's own rate" in text
    assert "an old run" not in text and text.endswith(f"{NOTES_MARKER}\nhand-written\n")
    assert "| mine | 1× |" in text and "| mine | 2× |" in text
    for stem in ("goodput_vs_load", "ttft_p95_vs_load", "hit_rate_vs_load"):
        assert (tmp_path / "out" / "page" / f"mine-{stem}.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr()
    assert "checks:" in out.out and "0 of 0" not in out.out
    assert "[3/3]" in out.err  # 1x seed 0, 2x seeds 0 and 1


def _burst_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    """The default policy's JSON row for twelve 2k-token requests stamped at one instant."""
    trace = tmp_path / "burst.jsonl"
    write_trace(
        [TraceRecord(0, 4 * 512, 4, (1000 + 4 * i + j for j in range(4))) for i in range(12)], trace
    )
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", registry.DEFAULT_PROFILE, "--no-progress", "--json", *extra]
    assert main(argv) == 0
    (row,) = [r for r in json.loads(capsys.readouterr().out) if r["default"]]
    return row


def test_arrival_spread_turns_a_recorded_burst_into_arrivals_over_the_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    burst = _burst_rows(tmp_path, capsys)
    spread = _burst_rows(tmp_path, capsys, "--arrival-spread-ms", "60000")
    assert spread["requests"] == burst["requests"] == 12
    # All at once, the twelve queue behind each other; over a minute, hardly at all.
    assert spread["queue_p95_ms"] < burst["queue_p95_ms"]
    again = _burst_rows(tmp_path, capsys, "--arrival-spread-ms", "60000")
    assert again == spread  # one seed, one placement
    other = _burst_rows(tmp_path, capsys, "--arrival-spread-ms", "60000", "--seed", "1")
    assert other["ttft_p50_ms"] != spread["ttft_p50_ms"]


def test_a_negative_arrival_spread_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(_simulate(tmp_path, "--arrival-spread-ms", "-5"))
    assert exited.value.code == 2
    assert "--arrival-spread-ms" in capsys.readouterr().err


def test_a_bucketed_trace_gets_a_note_on_spreading_its_arrivals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "buckets.jsonl"
    records = [TraceRecord(3000 * (i // 4), 512, 4, (500 + i,)) for i in range(12)]
    write_trace(records, trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "round-robin", "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "4.0 requests per timestamp, about 3000 ms apart" in err
    assert "--arrival-spread-ms 3000" in err
    assert main([*argv, "--arrival-spread-ms", "3000"]) == 0
    assert "--arrival-spread-ms" not in capsys.readouterr().err
    # Six requests 100 ms apart: nothing to say.
    assert main(_simulate(tmp_path)) == 0
    assert "--arrival-spread-ms" not in capsys.readouterr().err


def test_the_benchmark_replays_a_mixed_fleet_as_simulate_takes_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = routing_quality._parser()
    plan = routing_quality._plan(
        parser.parse_args(["--profile", "h100-llama3-8b:2,a100-llama3-8b:2", "--workloads", "rag"])
    )
    assert (plan.config.replicas, plan.config.profile) == (4, "h100-llama3-8b:2,a100-llama3-8b:2")
    with pytest.raises(SystemExit):
        routing_quality.main(["--profile", "h100-llama3-8b:2", "--replicas", "3"])
    assert "makes 2 replicas, not 3" in capsys.readouterr().err


# The simulate review of session 46: each of these ran on, silently wrong or out of memory.


@pytest.mark.parametrize(("mix", "said"), [("", "empty"), ("bogus=1", "bogus")])
def test_a_bad_class_mix_is_a_usage_error_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mix: str, said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(_simulate(tmp_path, "--classes", mix))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --classes" in err and said in err


def test_a_class_mix_the_trace_cannot_follow_gets_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Six requests under one shared first block, too few for any block to count as common: one
    # conversation, so one class for every request.
    trace = tmp_path / "one-prompt.jsonl"
    write_trace([TraceRecord(i * 100, 2 * 512, 4, (7, 100 + i)) for i in range(6)], trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "round-robin", "--no-progress"]
    assert main([*argv, "--classes", "critical=0.5,standard=0.5"]) == 0
    err = capsys.readouterr().err
    assert "6 requests hold 1 conversation(s)" in err
    assert main([*argv, "--classes", "standard=1"]) == 0  # the mix itself: nothing to say
    assert "conversation(s)" not in capsys.readouterr().err


def test_a_rate_scale_past_what_the_clock_keeps_exact_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_simulate(tmp_path, "--rate-scale", "1,1e-300")) == 2
    err = capsys.readouterr().err
    assert "--rate-scale 1e-300" in err and "at least" in err


def test_a_fleet_past_the_free_memory_is_refused_before_it_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleetgate.commands import simulate

    monkeypatch.setattr(simulate, "_available_memory_bytes", lambda: 2**20)  # 1 MiB free
    argv = _simulate(tmp_path)
    argv[argv.index("--replicas") + 1] = "64"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--replicas 64 would take about" in err and "fewer --jobs" in err


def test_the_memory_check_counts_only_the_workers_a_sweep_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session-46 review of that session's change: --jobs 16 with one run was charged for
    16 fleets, and refused a fleet that one worker holds."""
    from fleetgate.commands import simulate
    from planning.simulator import SimulationConfig
    from planning.simulator.api import engine_configs_for

    one_fleet = sum(
        c.num_gpu_blocks for c in engine_configs_for(SimulationConfig(replicas=2, profile="tiny"))
    ) * simulate.BYTES_PER_BLOCK
    monkeypatch.setattr(simulate, "_available_memory_bytes", lambda: 2 * one_fleet)
    argv = _simulate(tmp_path, "--jobs", "16")
    argv[argv.index("--policies") + 1] = "round-robin"  # one policy at one scale: one worker
    assert main(argv) == 0
    assert main([*argv, "--rate-scale", "1,2,3"]) == 2  # three workers, three fleets
    assert "fewer --jobs" in capsys.readouterr().err


def test_a_worker_that_dies_is_a_clear_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures.process import BrokenProcessPool

    from planning.simulator import api

    def killed(*_args: object, **_kwargs: object) -> None:
        raise BrokenProcessPool("A process in the process pool was terminated abruptly")

    monkeypatch.setattr(api, "simulate_sweep", killed)
    assert main(_simulate(tmp_path, "--jobs", "2")) == 2
    assert "a worker process died mid-replay" in capsys.readouterr().err
