"""The fleet simulator on tiny traces: determinism, hit rates against ceilings, policy ordering."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from fleetgate.cli import main
from planning.simulator import (
    JSON_FIELDS,
    SimulationConfig,
    TraceRequest,
    prepare_requests,
    simulate,
)
from planning.simulator.api import simulate_sweep
from routing.engine import Profile
from traces.format import TraceRecord, write_trace

#: The tiny engine (L4 + 50M-parameter model) with room for every test prompt: fast to simulate.
BIG_CACHE = {"num_gpu_blocks_override": 4096, "max_model_len": 8192}


def _record(at_ms: int, ids: Sequence[int], length: int | None = None, out: int = 4) -> TraceRecord:
    return TraceRecord(at_ms, length if length is not None else 512 * len(ids), out, tuple(ids))


def _config(replicas: int = 1, **overrides: object) -> SimulationConfig:
    settings: dict[str, object] = {
        "replicas": replicas,
        "profile": "tiny",
        "engine_overrides": BIG_CACHE,
    }
    settings.update(overrides)
    return SimulationConfig(**settings)  # type: ignore[arg-type]


def _shared_prefix_trace(groups: int, per_group: int, gap_ms: int) -> list[TraceRecord]:
    """``groups`` 3-block prefixes, interleaved so consecutive requests belong to other groups."""
    records = []
    next_id = 1000
    for turn in range(per_group):
        for group in range(groups):
            prefix = [group * 10 + 1, group * 10 + 2, group * 10 + 3]
            records.append(_record((turn * groups + group) * gap_ms, [*prefix, next_id]))
            next_id += 1
    return records


def test_one_replica_with_a_big_cache_reaches_the_unbounded_ceiling() -> None:
    # Spaced arrivals: each request finishes before the next, so nothing hides a hit.
    records = [
        _record(0, [1, 2]),
        _record(5_000, [1, 2, 3]),  # shares blocks 1, 2: 1024 cached tokens
        _record(10_000, [1, 4]),  # shares block 1: 512
        _record(15_000, [7, 8], length=700),  # new chain, partial last block
        _record(20_000, [7, 8], length=700),  # same prompt: all but the last token's block
    ]
    report = simulate(prepare_requests(records), ["round-robin"], _config())
    # The prompt's last token is always recomputed: 700 tokens -> (699 // 16) * 16 = 688 cached.
    expected = (1024 + 512 + 688) / sum(r.input_length for r in records)
    assert report.ceilings.unbounded == pytest.approx(expected)
    assert report.ceilings.pooled == pytest.approx(expected)
    assert report.summaries[0].prefix_hit_rate == pytest.approx(expected)


def test_ceilings_leave_out_the_requests_the_engines_refuse() -> None:
    # The same prompt three times, then a prompt over the context window that shares nothing:
    # no engine ever holds its blocks, so it must not weigh down the ceilings (a policy's hit
    # rate, over the requests served, then beat the "unbounded" ceiling).
    too_long = 9_000  # past the 8,192-token window of BIG_CACHE
    records = [
        _record(0, [1, 2]),
        _record(5_000, [1, 2]),
        _record(10_000, [1, 2]),
        _record(15_000, list(range(100, 100 + -(-too_long // 512))), length=too_long),
    ]
    report = simulate(prepare_requests(records), ["round-robin"], _config())
    assert report.runs["round-robin"].rejected == 1
    served = report.summaries[0].prefix_hit_rate
    assert report.ceilings.unbounded == pytest.approx(served)
    assert report.ceilings.pooled == pytest.approx(served)


def test_a_request_over_the_context_window_is_refused_without_building_its_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulate review: a 200,000-block line built its 102M-token prompt (5.7 GB, 26 s) in
    every run before the engines refused it. Its routing chain is all a replay needs of it."""
    from planning.simulator.prompts import PromptFactory

    built: list[int] = []
    tokens = PromptFactory.tokens

    def recording(self: PromptFactory, hash_ids: tuple[int, ...], length: int) -> list[int]:
        built.append(length)
        return tokens(self, hash_ids, length)

    monkeypatch.setattr(PromptFactory, "tokens", recording)
    too_long = 40_000  # past the 8,192-token window of the config below
    records = [
        _record(0, [1, 2]),
        _record(1_000, list(range(100, 100 + -(-too_long // 512))), length=too_long),
        _record(2_000, [1, 2]),
    ]
    report = simulate(prepare_requests(records), ["round-robin"], _config())
    assert report.runs["round-robin"].rejected == 1
    assert "maximum context length" in (report.runs["round-robin"].rejection_example or "")
    assert built and max(built) < too_long


def test_a_run_failing_in_a_worker_fails_the_sweep() -> None:
    records = _shared_prefix_trace(groups=2, per_group=2, gap_ms=50)
    with pytest.raises(Exception, match="no-such-policy"):
        simulate_sweep(records, [1.0, 2.0], ["round-robin", "no-such-policy"], _config(), jobs=2)


#: Made by the first ``_fails_once`` profile to run; every later one stalls instead.
_FAILED_ONCE_FLAG = Path("unset")


def _stalls() -> Profile:
    """A profile factory that never returns: its worker is mid-run until something stops it."""
    while True:
        time.sleep(3600)


def _fails_once() -> Profile:
    """The first call fails (after its neighbour's run has started); later ones stall, so a
    worker that shrugs off SIGTERM and takes the next queued run would run on for ever."""
    try:
        os.close(os.open(_FAILED_ONCE_FLAG, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return _stalls()
    time.sleep(1)
    raise RuntimeError("planned failure")


def test_a_failed_sweep_stops_its_workers_even_mid_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 45's test run ended with two forked pytest children still running. The workers
    inherited the parent's SIGTERM handler (raise ``SystemExit``), and the pool's worker loop
    catches that as a task's failure: a worker stopped mid-run went on to the next queued run."""
    import multiprocessing

    monkeypatch.setattr(sys.modules[__name__], "_FAILED_ONCE_FLAG", tmp_path / "failed")
    before = set(multiprocessing.active_children())
    records = _shared_prefix_trace(groups=2, per_group=2, gap_ms=50)
    factories = {"stalls": _stalls, "fails": _fails_once}
    try:
        with pytest.raises(RuntimeError, match="planned failure"):
            simulate_sweep(
                records, [1.0, 2.0, 3.0], ["stalls", "fails"], _config(), jobs=2,
                profile_factories=factories,
            )
        workers = set(multiprocessing.active_children()) - before
        # Polled rather than joined: a join returns once a dying worker has closed its end of
        # the sentinel pipe, a moment before the kernel has it exited.
        deadline = time.monotonic() + 30
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [w for w in workers if w.is_alive()] == []
    finally:
        for worker in set(multiprocessing.active_children()) - before:
            worker.kill()
            worker.join()


def test_jobs_replay_in_worker_processes_with_the_same_results() -> None:
    records = _shared_prefix_trace(groups=4, per_group=5, gap_ms=50)
    config = _config(replicas=2)
    policies = ["round-robin", "cache-aware"]
    alone = simulate_sweep(records, [1.0, 2.0], policies, config)
    pooled = simulate_sweep(records, [1.0, 2.0], policies, config, jobs=2)
    assert [p.rate_scale for p in pooled] == [1.0, 2.0]
    for a, b in zip(alone, pooled, strict=True):
        assert a.report.summaries == b.report.summaries
        assert a.report.ceilings == b.report.ceilings
        assert list(b.report.runs) == policies


def test_pooled_ceiling_evicts_least_recently_used_blocks() -> None:
    from planning.simulator import hit_rate_ceilings

    records = [_record(0, [1, 2]), _record(1, [3, 4]), _record(2, [1, 2])]
    # Room for two trace blocks: the third request's prefix was evicted by the second request.
    tight = hit_rate_ceilings(records, 512, 16, pooled_capacity_tokens=1024)
    roomy = hit_rate_ceilings(records, 512, 16, pooled_capacity_tokens=4096)
    repeat_hit = (1024 - 1) // 16 * 16
    assert tight.unbounded == pytest.approx(repeat_hit / 3072)
    assert tight.pooled == 0.0
    assert roomy.pooled == pytest.approx(repeat_hit / 3072)


def test_adapters_never_share_cached_blocks() -> None:
    from planning.simulator import hit_rate_ceilings

    base = _record(0, [1, 2])
    tuned = TraceRecord(1, 1024, 4, (1, 2), adapter="ft-a")
    assert hit_rate_ceilings([base, tuned], 512, 16, 10**6).unbounded == 0.0
    again = TraceRecord(2, 1024, 4, (1, 2), adapter="ft-a")
    assert hit_rate_ceilings([base, tuned, again], 512, 16, 10**6).unbounded > 0.0


def test_cache_aware_beats_round_robin_on_shared_prefixes() -> None:
    requests = prepare_requests(_shared_prefix_trace(groups=6, per_group=6, gap_ms=200))
    report = simulate(requests, ["round-robin", "cache-aware"], _config(replicas=4))
    hit = {s.policy: s.prefix_hit_rate for s in report.summaries}
    # Round-robin spreads every group over all four replicas, so each group misses up to four
    # times; cache-aware sends a group back where its prefix lives.
    assert hit["cache-aware"] > hit["round-robin"] + 0.1
    assert hit["cache-aware"] <= report.ceilings.unbounded + 1e-9


def test_same_seed_same_results_and_the_seed_matters() -> None:
    requests = prepare_requests(_shared_prefix_trace(groups=5, per_group=4, gap_ms=20))
    policies = ["random", "power-of-two", "expected-ttft"]

    def rows(seed: int) -> list[dict[str, object]]:
        report = simulate(requests, policies, _config(replicas=4, seed=seed))
        return [row.as_json() for row in report.rows()]

    first = rows(3)
    assert rows(3) == first
    assert any(a != b for a, b in zip(rows(4), first, strict=True))


def test_routing_learns_from_engine_kv_events_not_only_its_own_guesses() -> None:
    # One request per prefix, long after the speculative entries expired (TTL 1 s): only the
    # engines' BlockStored events can tell the router where each prefix lives.
    records = [_record(i * 3_000, [i % 3 + 1, 100 + i]) for i in range(9)]
    config = _config(replicas=3, speculative_ttl_s=1.0)
    report = simulate(prepare_requests(records), ["cache-aware"], config)
    # Requests 3..8 each find their one-block prefix (512 of 1024 tokens) where it was cached.
    assert report.summaries[0].prefix_hit_rate == pytest.approx(6 * 512 / (9 * 1024))


def test_goodput_follows_the_slos() -> None:
    requests = prepare_requests([_record(i * 100, [i, i + 1]) for i in range(6)])
    strict = simulate(requests, ["least-loaded"], _config(slo_ttft_ms=1e-6))
    loose = simulate(requests, ["least-loaded"], _config(slo_ttft_ms=1e9, slo_tpot_ms=1e9))
    assert strict.summaries[0].goodput == 0.0
    assert loose.summaries[0].goodput == 1.0


def test_rate_scale_and_limit() -> None:
    records = [_record(i * 1000, [i]) for i in range(5)]
    requests = prepare_requests(records, rate_scale=2.0, limit=3)
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0]
    assert all(isinstance(r, TraceRequest) for r in requests)


def test_json_output_has_exactly_the_documented_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(_shared_prefix_trace(groups=2, per_group=3, gap_ms=100), trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "round-robin,expected-ttft", "--json", "--no-progress"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["policy"] for row in rows] == [
        "round-robin",
        "expected-ttft",
        "unbounded",
        "pooled",
    ]
    for row in rows:
        assert list(row) == list(JSON_FIELDS)
    assert list(JSON_FIELDS) == [
        "policy",
        "rate_scale",
        "default",
        "requests",
        "rejected",
        "prefix_hit_rate",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p95_ms",
        "queue_p95_ms",
        "goodput",
        "output_tok_s",
        "cost_per_1m_usd",
        "load_imbalance",
        "preemptions",
        "overflow",
        "flow_control",
        "flow_control_blind",
        "goodput_by_class",
        "requests_by_class",
        "shed",
        "shed_by_class",
        "queued",
        "steered",
        "gateway_wait_p50_ms",
        "gateway_wait_p95_ms",
        "gateway_wait_max_ms",
    ]
    assert rows[0]["requests"] == 6
    assert rows[0]["flow_control"] is False


def test_cli_refuses_an_unknown_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace([_record(0, [1])], trace)
    assert main(["simulate", "--trace", str(trace), "--policies", "fastest"]) == 2
    assert "unknown policy fastest" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policies", "round-robin,round-robin"], "names round-robin twice"),
        (["--rate-scale", "1,1.0000001"], "scale 1 is listed twice"),
        (["--plot", "{file}"], "cannot write plots to"),
    ],
)
def test_cli_refuses_repeats_and_an_unwritable_plot_folder_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace([_record(0, [1])], trace)
    flags = [f.replace("{file}", str(trace)) for f in flags]  # a file is no folder for PNGs
    with pytest.raises(SystemExit) if "scale" in message else _no_exit():
        assert main(["simulate", "--trace", str(trace), *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_trace_that_is_not_text_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(b"\xff\xfe\x00binary")
    assert main(["simulate", "--trace", str(trace)]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err


@contextlib.contextmanager
def _no_exit() -> Iterator[None]:
    yield


def test_requests_the_engines_refuse_are_summed_up_once_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    trace = tmp_path / "trace.jsonl"
    records = [TraceRecord(i * 100, 400, 8, (i,)) for i in range(20)]
    too_long = 200_000  # past the tiny profile's context window
    records[5] = TraceRecord(500, too_long, 8, tuple(range(100, 100 + -(-too_long // 512))))
    write_trace(records, trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "expected-ttft,round-robin", "--json", "--no-progress"]
    with caplog.at_level("WARNING"):
        assert main(argv) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: engines refused")]
    assert len(warnings) == 1, err
    assert "{'expected-ttft': 1, 'round-robin': 1}" in warnings[0]
    assert "maximum context length" in warnings[0]
    assert not [r for r in caplog.records if "refused by" in r.getMessage()]


def test_a_replay_where_the_engines_refused_every_request_fails_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The simulate review: every prompt over the context window exited 0 with rows of dashes.
    trace = tmp_path / "trace.jsonl"
    too_long = 200_000
    ids = tuple(range(-(-too_long // 512)))
    write_trace([TraceRecord(i * 100, too_long, 8, ids) for i in range(5)], trace)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2"]
    argv += ["--policies", "round-robin", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the engines refused every request" in err and "maximum context length" in err


def test_results_with_stale_engine_figures_never_depend_on_the_machines_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``stats_interval_s`` > 0 routing reads engine figures of some age. The policies'
    wall clock is the replay's (``_Simulation.wall``): a machine that runs the replay slower or
    faster (here a wall clock that leaps an hour at each reading) gives the same figures."""
    from bench.workloads.generators import generate

    requests = prepare_requests(generate("b2b-lora", 300, 40.0, seed=0))
    config = SimulationConfig(stats_interval_s=0.1)

    def rows() -> list[dict[str, object]]:
        report = simulate(requests, ["fleet-cost", "expected-ttft"], config)
        return [row.as_json() for row in report.rows()]

    steady = rows()
    leaps = iter(range(1, 10**9))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0 * next(leaps))
    assert rows() == steady


POLICY_WITH_A_PROFILE = """\
version: 1
replica_pools:
  - {name: pool, replicas: ["http://a1"]}
models:
  - {name: model, pools: [pool]}
profiles:
  - name: least-loaded-copy        # the built-in least-loaded, defined in the file
    picker: least-loaded
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_cli_replays_the_profiles_a_policy_file_defines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(_shared_prefix_trace(groups=3, per_group=4, gap_ms=50), trace)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_WITH_A_PROFILE)
    argv = ["simulate", "--trace", str(trace), "--profile", "tiny", "--replicas", "2",
            "--config", str(policy), "--json", "--no-progress", "--jobs", jobs]
    assert main([*argv, "--policies", "least-loaded,least-loaded-copy"]) == 0
    rows = {row["policy"]: row for row in json.loads(capsys.readouterr().out)}
    builtin, copy = rows["least-loaded"], rows["least-loaded-copy"]
    assert {**copy, "policy": "least-loaded"} == builtin  # the same pipeline, the same replay
    # Without --policies, the file's profiles join the built-in ones.
    assert main(argv) == 0
    assert "least-loaded-copy" in {row["policy"] for row in json.loads(capsys.readouterr().out)}


def test_cli_names_the_flag_for_a_policy_file_profile_and_lists_a_bad_files_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace([_record(0, [1])], trace)
    assert main(["simulate", "--trace", str(trace), "--policies", "mine"]) == 2
    assert "add --config FILE" in capsys.readouterr().err
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nprofiles: [{name: mine}]\n")
    assert main(["simulate", "--trace", str(trace), "--config", str(policy)]) == 2
    err = capsys.readouterr().err
    assert f"{policy} is invalid" in err and "replica_pools: required key is missing" in err


def test_with_flow_control_a_request_no_engine_takes_is_refused_not_shed() -> None:
    """The simulate review of session 46: under overload flow control shed such a request (a
    miss for goodput) while at light load the engines refused it (left out of goodput), so the
    rows' denominators differed; the gateway now lets it through to the engine's refusal."""
    from planning.simulator.flow import parse_class_mix
    from routing.flow_control import FlowControlSettings

    burst = [_record(0, [i * 10 + 1, i * 10 + 2, i * 10 + 3, i * 10 + 4]) for i in range(24)]
    too_long = _record(0, list(range(900, 918)), length=9_000)  # past the 8,192-token window
    records = [*burst, too_long, *burst[:4]]
    config = _config(
        replicas=1,
        slo_ttft_ms=50.0,
        classes=parse_class_mix("sheddable=1"),
        flow_control=FlowControlSettings(),
    )
    run = simulate(prepare_requests(records), ["expected-ttft"], config).runs["expected-ttft"]
    assert run.shed  # the overload sheds ...
    assert run.rejected == 1  # ... but the request no engine takes is refused by them
