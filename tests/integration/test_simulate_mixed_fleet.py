"""``fleetgate simulate --profile NAME:N,NAME:N``: a mixed fleet, each profile's replicas a pool
of their own. Real fleets mix GPUs and context lengths (a heterogeneous-fleet review); the
simulator took one engine profile for every replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetgate.cli import main
from planning.simulator import SimulationConfig, prepare_requests, simulate
from planning.simulator.config import parse_profile_mix
from traces.format import TraceRecord, write_trace

#: Four short requests, then two longer than the ``tiny`` preset's 4,096-token context.
RECORDS = [TraceRecord(i * 50, 1024, 8, (i, 100 + i)) for i in range(4)] + [
    TraceRecord(300 + i * 50, 6144, 8, tuple(range(200 + 12 * i, 212 + 12 * i))) for i in range(2)
]


@pytest.mark.parametrize(
    ("spec", "replicas", "mix"),
    [
        ("h100-llama3-8b", 8, [("h100-llama3-8b", 8)]),
        ("h100-llama3-8b:4,a100-llama3-8b:2", 6, [("h100-llama3-8b", 4), ("a100-llama3-8b", 2)]),
        ("cpu.yaml:2", 2, [("cpu.yaml", 2)]),
    ],
)
def test_a_profile_is_one_preset_or_a_mix_with_counts(
    spec: str, replicas: int, mix: list[tuple[str, int]]
) -> None:
    assert parse_profile_mix(spec, replicas) == mix


@pytest.mark.parametrize("spec", ["a:0,b:2", "a:2,b", "a:x,b:1", ":2,b:1"])
def test_a_mix_without_counts_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="NAME:COUNT"):
        parse_profile_mix(spec, 3)


def test_a_mixed_fleet_routes_each_request_to_an_engine_that_can_take_it() -> None:
    requests = prepare_requests(RECORDS)
    mixed = SimulationConfig(replicas=2, profile="tiny:1,h100-llama3-8b:1")
    run = simulate(requests, ["round-robin"], mixed).runs["round-robin"]
    # Routing reads each engine's context: the long prompts go to the H100, none is refused,
    # and the short ones still use both.
    assert run.rejected == 0
    assert all(n > 0 for n in run.routed_per_replica) and run.routed_per_replica[1] >= 2
    assert run.price_per_hour == pytest.approx((0.8 + 3.0) / 2)  # x replicas: the fleet's bill
    alike = SimulationConfig(replicas=2, profile="tiny")
    assert simulate(requests, ["round-robin"], alike).runs["round-robin"].rejected == 2


def test_the_cli_counts_a_mixed_fleets_replicas_and_refuses_a_count_that_disagrees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(RECORDS, trace)
    argv = ["simulate", "--trace", str(trace), "--policies", "round-robin", "--no-progress"]
    assert main([*argv, "--profile", "tiny:1,h100-llama3-8b:1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["policy"] == "round-robin" and rows[0]["requests"] == 6
    assert main([*argv, "--profile", "tiny:1,h100-llama3-8b:1", "--replicas", "3"]) == 2
    assert "makes 2 replicas, --replicas 3" in capsys.readouterr().err
    assert main([*argv, "--profile", "tiny:1,h100-llama3-8b"]) == 2
    assert "a mixed fleet is NAME:COUNT,NAME:COUNT" in capsys.readouterr().err
