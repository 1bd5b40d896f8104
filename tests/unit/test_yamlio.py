"""The planning inputs' YAML loader reads numbers written with an exponent (YAML 1.2 style)."""

from __future__ import annotations

import pytest
import yaml

from planning import yamlio


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("70.6e9", 70_600_000_000),
        ("7e9", 7_000_000_000),
        ("1e3", 1000),
        ("8E3", 8000),
        ("-1e2", -100),
        ("8.03e+9", 8_030_000_000),
        ("2.5e-3", 0.0025),
        ("1.5", 1.5),
        ("12", 12),
        ('"1e3"', "1e3"),  # quoted stays a string
        ("e3", "e3"),
        ("1e", "1e"),
    ],
)
def test_exponent_numbers_are_numbers(text: str, value: object) -> None:
    loaded = yamlio.load(f"x: {text}\n")["x"]
    assert loaded == value and type(loaded) is type(value)


def test_pyyaml_itself_is_untouched() -> None:
    assert yaml.safe_load("x: 1e3\n") == {"x": "1e3"}  # why the loader exists
    assert yamlio.load("x: 1e3\n") == {"x": 1000}
    assert yaml.safe_load("x: 1e3\n") == {"x": "1e3"}


# The diff-rest review's finding 6: keys, overflowing values and what --save writes.


@pytest.mark.parametrize(
    ("text", "loaded"),
    [
        ("1e3: x\n", {"1e3": "x"}),  # a key is a name, never a number
        ("8.03e+9: x\n", {"8.03e+9": "x"}),
        ("{1e3: 1e3}\n", {"1e3": 1000}),  # the value still is one
        ("pools:\n  7e9: {replicas: 2e0}\n", {"pools": {"7e9": {"replicas": 2}}}),
        ("a: &A {1e3: 2}\nb: {<<: *A, c: 1}\n", {"a": {"1e3": 2}, "b": {"1e3": 2, "c": 1}}),
    ],
)
def test_mapping_keys_stay_strings(text: str, loaded: object) -> None:
    assert yamlio.load(text) == loaded


@pytest.mark.parametrize("text", ["4e10931", "1e400", "-1e400", "1_0e999"])
def test_a_value_too_large_for_a_float_stays_a_string(text: str) -> None:
    assert yamlio.load(f"rev: {text}\n") == {"rev": text}


def test_dump_quotes_what_load_would_read_as_a_number() -> None:
    data = {"1e3": {"model": "7e9", "rev": "4e10931", "n": 7e9, "m": 1000, "s": "8.03e+9"}}
    text = yamlio.load(yamlio.dump(data))
    assert text == data
    assert yamlio.load(yaml.safe_dump(data)) != data  # why dump exists


def test_advise_save_round_trips_a_pool_named_like_a_number(tmp_path, capsys) -> None:
    from fleetgate.cli import main

    snapshot = tmp_path / "pool1e3.yaml"
    snapshot.write_text(
        'pools:\n  "1e3":\n    model: "7e9"\n    flags: {max-model-len: 8e3}\n'
        "    measured: {context_p99: 1.5e3}\n"
    )
    saved = tmp_path / "saved.yaml"
    assert main(["advise", "--input", str(snapshot), "--save", str(saved), "--json"]) == 0
    first = capsys.readouterr().out
    assert main(["advise", "--input", str(saved), "--json"]) == 0
    again = capsys.readouterr().out
    assert '"1e3"' in again and again == first
