"""``fleetgate triage`` end to end on files (and a mocked gateway): output shapes, exit codes."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from fleetgate.cli import main
from fleetgate.commands import triage as triage_command

RAG = {"ttft_p95_ms": 2400, "ttft_slo_ms": 1000, "shared_prefix_fraction": 0.7}
HEALTHY = {
    "ttft_p95_ms": 300,
    "ttft_slo_ms": 2000,
    "tpot_p95_ms": 20,
    "tpot_slo_ms": 80,
    "kv_cache_usage": 0.4,
    "preemptions_per_min": 0,
    "fine_tuned_variants": 0,
}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["triage", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_single_mapping_prints_a_json_list(tmp_path, capsys) -> None:
    path = tmp_path / "rag.yaml"
    path.write_text(yaml.safe_dump(RAG))
    code, out, _ = _run(capsys, "--input", str(path), "--json")
    assert code == 0
    levers = json.loads(out)
    assert [item["lever"] for item in levers] == ["prefix-caching", "queueing", "queueing"]
    assert all(set(item) == {"lever", "reason"} for item in levers)


def test_routes_print_a_json_mapping(tmp_path, capsys) -> None:
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"rag": RAG, "internal": HEALTHY}))
    code, out, _ = _run(capsys, "--input", str(path), "--json")
    assert code == 0
    result = json.loads(out)
    assert list(result) == ["rag", "internal"]
    assert [item["lever"] for item in result["internal"]] == ["capacity-headroom"]


def test_text_output_numbers_levers_per_route(tmp_path, capsys) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"rag": RAG, "internal": HEALTHY}))
    code, out, _ = _run(capsys, "--input", str(path))
    assert code == 0
    assert "route rag:" in out and "route internal:" in out
    assert "1. [prefix-caching]" in out
    # rag's input has no TPOT, KV or fine-tune figures: the report says what it did not check.
    assert "not checked (unknown inputs)" in out


def test_command_line_slo_fills_missing_slo(tmp_path, capsys) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"tpot_p95_ms": 90}))
    _, out, _ = _run(capsys, "--input", str(path), "--json")
    assert "reduce-batch" not in out
    _, out, _ = _run(capsys, "--input", str(path), "--json", "--tpot-slo-ms", "50")
    assert [item["lever"] for item in json.loads(out)] == ["reduce-batch"]
    _, out, _ = _run(
        capsys, "--input", str(path), "--json", "--tpot-slo-ms", "50", "--quality-headroom"
    )
    assert [item["lever"] for item in json.loads(out)] == ["weight-quantization"]


def test_route_filter(tmp_path, capsys) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"rag": RAG, "internal": HEALTHY}))
    _, out, _ = _run(capsys, "--input", str(path), "--json", "--route", "internal")
    assert list(json.loads(out)) == ["internal"]
    code, _, err = _run(capsys, "--input", str(path), "--route", "nope")
    assert code == 2 and "--route nope: not in the input" in err


def test_bad_input_exits_2_with_the_field(tmp_path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"rag": {"kv_cache_usage": 94}}))
    code, out, err = _run(capsys, "--input", str(path))
    assert code == 2 and out == ""
    assert "rag.kv_cache_usage: must be in [0, 1] (got 94)" in err


def test_exactly_one_source_is_required(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["triage", "--input", "a.yaml", "--gateway", "http://gw"])
    assert info.value.code == 2


def test_gateway_source_via_cli(monkeypatch, capsys) -> None:
    text = (
        "# TYPE fleetgate_cache_busting_layout gauge\n"
        'fleetgate_cache_busting_layout{route="chat"} 1.0\n'
    )
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))
    real_client = httpx.Client
    monkeypatch.setattr(
        triage_command.httpx, "Client", lambda **kw: real_client(transport=transport, **kw)
    )
    code, out, _ = _run(capsys, "--gateway", "http://gw:8000", "--json")
    assert code == 0
    assert [item["lever"] for item in json.loads(out)["chat"]] == [
        "prefix-caching",
        "capacity-headroom",
    ]


def test_unreachable_source_exits_1(monkeypatch, capsys) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    real_client = httpx.Client
    monkeypatch.setattr(
        triage_command.httpx,
        "Client",
        lambda **kw: real_client(transport=httpx.MockTransport(refuse), **kw),
    )
    code, _, err = _run(capsys, "--prometheus", "http://prom:9090")
    assert code == 1 and "cannot read metrics" in err and "prom:9090" in err


def test_advice_snapshot_adds_the_advised_flag_value_to_levers(tmp_path, capsys) -> None:
    # A route pinned on KV: triage names --kv-cache-dtype fp8; advise, from the pool's own
    # engine flags, says by how much (auto -> fp8 on the FP8-capable pool).
    pinned = {
        "ttft_p95_ms": 3000,
        "ttft_slo_ms": 1000,
        "tpot_p95_ms": 90,
        "tpot_slo_ms": 50,
        "kv_cache_usage": 0.97,
        "preemptions_per_min": 12,
    }
    path = tmp_path / "route.json"
    path.write_text(json.dumps(pinned))
    advice = "tests/unit/fixtures/advise/fp8_capable_kv_pinned.json"
    code, out, _ = _run(capsys, "--input", str(path), "--json", "--advice", advice)
    assert code == 0
    reasons = [item["reason"] for item in json.loads(out)]
    noted = [r for r in reasons if "--kv-cache-dtype" in r and "fleetgate advise:" in r]
    assert noted and "-> fp8" in noted[0], reasons
    # Without the snapshot the same levers carry no advice.
    code, out, _ = _run(capsys, "--input", str(path), "--json")
    assert all("fleetgate advise:" not in item["reason"] for item in json.loads(out))


def test_unreadable_advice_snapshot_is_exit_2(tmp_path, capsys) -> None:
    path = tmp_path / "route.json"
    path.write_text(json.dumps(RAG))
    code, _, err = _run(capsys, "--input", str(path), "--advice", str(tmp_path / "missing.json"))
    assert code == 2 and "--advice" in err


def test_input_file_queue_growth_fires_the_kv_lever_advise_agrees_with(tmp_path, capsys) -> None:
    # The review's tri.yaml plus the growth advise saw: triage and advise now agree (FP8 KV).
    route = {
        "kv_cache_usage": 0.95,
        "preemptions_per_min": 0,
        "waiting_mean": 0.5,
        "waiting_growth_per_min": 3,
        "ttft_p95_ms": 500,
        "ttft_slo_ms": 1000,
    }
    path = tmp_path / "tri.yaml"
    path.write_text(yaml.safe_dump(route))
    code, out, _ = _run(capsys, "--input", str(path), "--json")
    assert code == 0
    assert json.loads(out)[0]["lever"] == "kv-quantization"
    code, out, _ = _run(capsys, "--input", str(path))
    assert "queue +3.0/min" in out
