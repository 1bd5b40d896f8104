"""Smoke test of ``bench/forty_tunes.py`` on a tiny configuration (a few seconds)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from bench import forty_tunes as ft
from bench.workloads import generate
from routing.contracts import RoutingRequest
from routing.state import ReplicaState
from routing.types import ReplicaId


def _scenario(**changes: object) -> ft.Scenario:
    settings: dict[str, object] = {
        "exponent": 1.4,
        "rate": 12.0,
        "requests": 400,
        "replicas": 2,
        "max_loras": 4,
        "max_cpu_loras": 4,
        "profile": "h100-llama3-8b",
        "slo_ttft_ms": 2000.0,
        "slo_tpot_ms": 50.0,
        "seed": 0,
    }
    settings.update(changes)
    return ft.Scenario(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sweep() -> ft.Sweep:
    grid = [_scenario()]
    fleet = [_scenario(replicas=3)]
    ablation = [dataclasses.replace(grid[0], free_loads=True)]
    policies = [ft.AWARE, ft.BLIND_TTFT, "round-robin"]
    return ft.run_sweep(grid, fleet, policies, jobs=1, progress=False, ablation=ablation)


def test_trace_matches_the_b2b_lora_shape_at_its_own_exponent() -> None:
    ours = ft.forty_tunes_trace(50, 5.0, ft.ZIPF_EXPONENT, seed=3)
    assert ours == generate("b2b-lora", 50, 5.0, seed=3)
    skewed = ft.forty_tunes_trace(50, 5.0, 2.0, seed=3)
    # The exponent changes only the customer (and so the system prompt), not the timing, the
    # request's own tokens or the output length.
    assert [(r.timestamp, r.output_length) for r in skewed] == [
        (r.timestamp, r.output_length) for r in ours
    ]
    assert [r.adapter for r in skewed] != [r.adapter for r in ours]
    assert all(r.adapter and r.adapter.startswith("ft-") for r in skewed)


def test_blind_scorer_zeroes_adapter_loads_and_registry_scorer_prices_them() -> None:
    replicas = [
        ReplicaState(replica_id=ReplicaId(name), url=f"sim://{name}", models=frozenset({"m"}))
        for name in ("warm", "cold")
    ]
    replicas[0].loaded_adapters = frozenset({"ft-01"})

    def request() -> RoutingRequest:
        return RoutingRequest(
            request_id="r", model="m", tenant="t", route="r", adapter="ft-01", prompt_tokens=100
        )

    aware = ft.profile_for(ft.AWARE).scorers[0][0]
    blind = ft.profile_for(ft.BLIND_TTFT).scorers[0][0]
    _, aware_terms = aware.score_with_terms(request(), replicas)
    _, blind_terms = blind.score_with_terms(request(), replicas)
    assert aware_terms[ReplicaId("cold")]["adapter_cold_load_ms"] > 0
    assert blind_terms[ReplicaId("cold")]["adapter_cold_load_ms"] == 0
    assert blind_terms[ReplicaId("warm")]["adapter_cold_load_ms"] == 0
    registry = ft.profile_for(ft.REGISTRY_TTFT).scorers[0][0]
    _, registry_terms = registry.score_with_terms(request(), replicas)
    assert registry_terms[ReplicaId("warm")]["adapter_cold_load_ms"] == 0
    assert 50 < registry_terms[ReplicaId("cold")]["adapter_cold_load_ms"] < 500


def test_sweep_structure(sweep: ft.Sweep) -> None:
    assert len(sweep.results) == 3 * 3
    assert {r.policy for r in sweep.results} == {ft.AWARE, ft.BLIND_TTFT, "round-robin"}
    for result in sweep.results:
        assert result.summary.requests == result.scenario.requests
        assert result.loads >= result.loads_after_warmup >= 0
        assert result.makespan_s > 0
        assert result.load_share >= 0
    (dedicated,) = sweep.dedicated
    assert len(dedicated.tunes) == ft.ADAPTERS
    assert dedicated.gpus >= ft.ADAPTERS  # at least one replica per fine-tune
    assert math.isclose(sum(t.share for t in dedicated.tunes), 1.0)
    assert dedicated.busiest is not None and dedicated.busiest.requests
    assert [s.replicas for s in sweep.fleet_scenarios()] == [2, 3]
    pairs = ft.ablation_pairs(sweep)
    assert len(pairs) == 3
    for real, free in pairs:
        assert free.scenario.free_loads and not real.scenario.free_loads
        assert real.load_share > 0 and free.load_share < 1e-6


def test_adapter_aware_routing_loads_fewer_adapters_than_blind(sweep: ft.Sweep) -> None:
    scenario = sweep.grid[0]
    aware = sweep.result(scenario, ft.AWARE)
    assert aware.loads > 0
    for policy in (ft.BLIND_TTFT, "round-robin"):
        assert aware.loads < sweep.result(scenario, policy).loads, policy


def test_page_and_figure(sweep: ft.Sweep, tmp_path: Path) -> None:
    page = ft.render_page(sweep, ".venv/bin/python -m bench.forty_tunes", "x.png")
    for needed in (
        "## Command",
        "## Results",
        "### Findings",
        "## How small",
        "## Where the TTFT goes",
        "dedicated",
    ):
        assert needed in page
    rows = [line for line in ft.headline_table(sweep) if line.startswith("| 12 req/s")]
    assert len(rows) == 3 + 1  # three policies and the dedicated baseline
    out = tmp_path / "page.md"
    out.write_text("old\n" + ft.NOTES_MARKER + "\nhand-written\n")
    ft.write_page(out, page)
    assert out.read_text().endswith(ft.NOTES_MARKER + "\nhand-written\n")
    ft.write_png(sweep, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_cli_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        ft.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "adapter loads/min" in help_text and "Erlang-C" in help_text
    for bad in (["--zipf", "x"], ["--rates", "0"], ["--max-loras", "8", "--max-cpu-loras", "2"]):
        with pytest.raises(SystemExit) as exit_info:
            ft.main([*bad, "--no-write"])
        assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        ft.main(["--policies", "round-robin", "--no-write"])


def test_uncached_tokens_counts_whole_seen_blocks() -> None:
    from traces.format import TraceRecord

    records = [
        TraceRecord(0, 1000, 1, (1, 2)),
        TraceRecord(1, 1000, 1, (1, 3)),
        TraceRecord(2, 1000, 1, (1, 2)),
    ]
    assert ft.uncached_tokens(records, 512) == [1000, 488, 1]
