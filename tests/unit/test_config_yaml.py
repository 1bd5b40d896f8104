"""Reading the file itself: syntax errors with file:line, duplicate keys, odd documents."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from routing.config import PolicyError, load_policy
from tests.unit.test_config_fixtures import BASE, FAKE_CATALOG, errors_of, mutate, parse

GOOD = yaml.safe_dump(BASE, sort_keys=False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version: 1\nmodels: [a, b\n", "<string>:3: YAML syntax error:"),
        ("version: 1\n  bad: indent\n", "<string>:2: YAML syntax error:"),
        (
            "version: 1\nversion: 1\n",
            "<string>:2: YAML syntax error: duplicate key 'version' (first on line 1)",
        ),
        ("version: 1\n1: x\n", "<string>:2: YAML syntax error: mapping key 1 must be a string"),
        ("a: 1\n---\nb: 2\n", "<string>:2: YAML syntax error:"),
        ("", "<string>: policy is empty"),
        ("# only a comment\n", "<string>: policy is empty"),
        ("- version: 1\n", "<string>:1: the top level must be a mapping of sections (got a list)"),
        ("just text", "<string>:1: the top level must be a mapping of sections (got 'just text')"),
    ],
)
def test_unreadable_documents(text: str, expected: str) -> None:
    errors = errors_of(text)
    assert len(errors) == 1 and errors[0].startswith(expected), errors


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # A terminal's colour code pasted in: PyYAML's ReaderError escaped as a traceback, and
        # a running gateway's file poller died on it (the operator review of session 46).
        ("version: 1\nmodels: \x1b[0m\n", "<string>: YAML error:"),
        ("version: 1\n" + "a: [" * 3000 + "]" * 3000 + "\n", "<string>: YAML nested too deeply"),
        # Nine nested levels of nine aliases each: 254 bytes took 4.4 s and 1.2 GB to read.
        (
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n"
                for p, n in zip("abcdefgh", "bcdefghi", strict=True)
            ),
            "<string>: its aliases (*name) expand to more than 100,000 repeated YAML nodes",
        ),
        ("version: 1\nmodels:\n\t- a\n", "YAML cannot indent with tabs: use spaces"),
    ],
)
def test_documents_no_policy_reader_should_choke_on(text: str, expected: str) -> None:
    errors = errors_of(text)
    assert len(errors) == 1 and expected in errors[0], errors


def test_duplicate_key_deep_inside_is_reported_with_its_line() -> None:
    text = GOOD.replace("  slo:\n", "  slo:\n    ttft_p95_ms: 1\n", 1)
    errors = errors_of(text)
    line = text.splitlines().index("    ttft_p95_ms: 500") + 1
    assert errors == [
        f"<string>:{line}: YAML syntax error: duplicate key "
        f"'ttft_p95_ms' (first on line {line - 1})"
    ]


def test_merge_keys_may_be_overridden() -> None:
    text = GOOD + ("gateway: &gw\n  max_retries: 1\nadmin:\n  api_key_sha256: []\n")
    parse(yaml.safe_load(text))  # anchors alone are fine
    merged = text.replace(
        "gateway: &gw\n  max_retries: 1\n",
        "x-defaults: &gw\n  max_retries: 1\n  max_body_bytes: 10\n"
        "gateway:\n  <<: *gw\n  max_retries: 3\n",
    )
    merged_doc = yaml.safe_load(merged)
    merged_doc.pop("x-defaults")
    policy = parse(merged_doc)
    assert policy.gateway.max_retries == 3 and policy.gateway.max_body_bytes == 10


def test_a_large_document_without_aliases_is_read_whole() -> None:
    """The session-46 review of that session's change: its node limit counted every node, and
    refused a plain 2.2 MB policy (15,000 tenants) that had read before."""
    from routing.config.yaml_source import read_yaml

    # 30,000 mappings of three more nodes each: 120,000 nodes, none of them an alias.
    text = "items:\n" + "".join(f"  - {{name: t{i}, keys: [k{i}]}}\n" for i in range(30_000))
    data, lines = read_yaml(text, "big.yaml")
    assert len(data["items"]) == 30_000
    assert lines[("items", 29_999)] == 30_001


def test_a_key_merged_in_is_placed_on_its_own_line() -> None:
    """The same review: with the line map built before the document, a key merged in by
    ``<<: *anchor`` was placed on the line of the mapping it was merged into."""
    from routing.config.yaml_source import read_yaml

    text = "defaults: &d\n  retries: 1\n  timeout: 2\nservice:\n  <<: *d\n  retries: 3\n"
    data, lines = read_yaml(text, "merge.yaml")
    assert data["service"] == {"retries": 3, "timeout": 2}
    assert lines[("service", "timeout")] == 3


def test_yaml_booleans_are_not_names() -> None:
    # YAML 1.1 reads `no` as false: a tenant called "no" must be quoted, and the error says so.
    text = GOOD.replace("name: globex", "name: no")
    assert any("tenants[1].name: must be a string (got false)" in e for e in errors_of(text))


def test_load_policy_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(mutate("routes[0].slo.ttft_p95_ms", -5), sort_keys=False))
    with pytest.raises(PolicyError) as info:
        load_policy(path, catalog=FAKE_CATALOG)
    assert len(info.value.errors) == 1
    assert info.value.errors[0].startswith(f"{path}:")
    assert info.value.errors[0].endswith("routes[0].slo.ttft_p95_ms: must be > 0 (got -5)")
    assert info.value.issues[0].path == "routes[0].slo.ttft_p95_ms"


def test_load_policy_reports_missing_and_undecodable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "absent.yaml", catalog=FAKE_CATALOG)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"version: 1\n\xff\xfe")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(binary, catalog=FAKE_CATALOG)


def test_load_policy_round_trips_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(GOOD)
    policy = load_policy(path, catalog=FAKE_CATALOG)
    assert policy.source == str(path)
    assert policy.model_dump() == parse(BASE).model_dump()
