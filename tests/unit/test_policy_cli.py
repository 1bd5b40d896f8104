"""``fleetgate policy``: validate / show / hash-key through the real CLI entry point."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest

from fleetgate.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
EXAMPLE = EXAMPLES / "policy.yaml"
BROKEN = EXAMPLES / "broken"


def test_example_policy_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", str(EXAMPLE)]) == 0
    out, err = capsys.readouterr()
    # The one warning it may give: its local tokenizer is on the gateway's disk, not this one's.
    if not Path("/models/llama-3.1-8b-instruct/tokenizer.json").is_file():
        assert err.splitlines() == [
            f"{EXAMPLE}: warning: models[0] (meta-llama/Llama-3.1-8B-Instruct): tokenizer path "
            "/models/llama-3.1-8b-instruct has no tokenizer.json on this machine. Fine if "
            "validation runs elsewhere, but the gateway that loads this policy refuses to start "
            "without it: mount the model files there, or use {kind: remote, url: <engine URL>}"
        ]
    else:
        assert err == ""
    lines = out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"{EXAMPLE}: OK: policy v1: 2 pools")
    assert "index=redis" in lines[0]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "unknown_key.yaml",
            ":13: routes[0].slo.ttft_p59_ms: unknown key; did you mean 'ttft_p95_ms'? "
            "(allowed: ttft_p95_ms, tpot_p95_ms)",
        ),
        ("bad_reference.yaml", ":12: routes[0].profile: unknown profile 'rag-fast'"),
        ("negative_slo.yaml", ":14: routes[1].slo.ttft_p95_ms: must be > 0 (got -5)"),
        ("yaml_syntax.yaml", ":7: YAML syntax error:"),
        ("wrong_type.yaml", ":7: replica_pools[0].block_size: must be an integer (got '16')"),
        ("raw_api_key.yaml", ":12: tenants[0].api_key_sha256[0]: must be the hex SHA-256"),
    ],
)
def test_broken_policies_exit_1_naming_path_and_line(
    capsys: pytest.CaptureFixture[str], name: str, expected: str
) -> None:
    path = BROKEN / name
    assert main(["policy", "validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    errors = err.splitlines()
    assert any(line.startswith(f"{path}{expected}") for line in errors), errors
    assert "DO-NOT-LEAK" not in err


def test_every_broken_example_is_covered() -> None:
    # A new broken file must get an expectation above, or it tests nothing.
    covered = {
        "unknown_key.yaml",
        "bad_reference.yaml",
        "negative_slo.yaml",
        "yaml_syntax.yaml",
        "wrong_type.yaml",
        "raw_api_key.yaml",
    }
    assert {p.name for p in BROKEN.glob("*.yaml")} == covered


def test_several_files_exit_1_if_any_is_invalid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", "-q", str(EXAMPLE), str(BROKEN / "wrong_type.yaml")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "wrong_type.yaml:7:" in err
    # The example is valid: at most a warning (its local tokenizer is not on this machine).
    assert all(": warning: " in line for line in err.splitlines() if str(EXAMPLE) in line)


def test_missing_file_is_an_error_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "nope.yaml"
    assert main(["policy", "validate", str(path)]) == 1
    assert f"{path}: cannot read" in capsys.readouterr().err


def test_show_prints_the_effective_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "show", str(EXAMPLE), "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    acme = next(t for t in shown["tenants"] if t["name"] == "acme")
    assert len(acme["cache_salt"]) == 32  # derived, since the file sets none
    assert shown["gateway"]["max_retries"] == 2


def test_show_refuses_an_invalid_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "show", str(BROKEN / "negative_slo.yaml")]) == 1
    assert "must be > 0" in capsys.readouterr().err


def test_hash_key_reads_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-example-acme-1\n"))
    assert main(["policy", "hash-key"]) == 0
    expected = hashlib.sha256(b"sk-example-acme-1").hexdigest()
    assert capsys.readouterr().out.strip() == expected
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["policy", "hash-key"]) == 1


def test_no_action_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy"]) == 2
    assert "validate" in capsys.readouterr().err


def test_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["policy", "validate", "--help"])
    assert exit_info.value.code == 0
    assert "fleetgate policy validate deploy/examples/policy.yaml" in capsys.readouterr().out


def test_show_prints_no_password_written_in_a_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The security review: `show` printed a literal Redis password (validate warns about it).
    text = EXAMPLE.read_text().replace(
        "redis://redis.fleetgate.svc:6379/0", "redis://:S3cret-pw@redis.fleetgate.svc:6379/0"
    )
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert main(["policy", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "S3cret-pw" not in out
    assert "redis://:***@redis.fleetgate.svc:6379/0" in out
