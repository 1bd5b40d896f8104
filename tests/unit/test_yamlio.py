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
