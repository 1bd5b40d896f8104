"""Error formatting: paths, safe value rendering, and pydantic error translation."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from routing.config.errors import PolicyError, describe_value, format_path, issues_from_validation


@pytest.mark.parametrize(
    ("loc", "path"),
    [
        (("routes", 2, "slo", "ttft_p95_ms"), "routes[2].slo.ttft_p95_ms"),
        (("prices", "gpu_per_hour", "h100.8b"), "prices.gpu_per_hour['h100.8b']"),
        ((), ""),
        (("a", 0, 1), "a[0][1]"),
    ],
)
def test_format_path(loc: tuple[str | int, ...], path: str) -> None:
    assert format_path(loc) == path


@pytest.mark.parametrize(
    ("value", "loc", "shown"),
    [
        (-5, (), "-5"),
        ("x", (), "'x'"),
        (True, (), "true"),
        (None, (), "null"),
        ({"a": 1}, (), "a mapping"),
        ([1], (), "a list"),
        ("redis://user:pw@host:6379", (), "'redis://<redacted>@host:6379'"),
        ("sk-live-123", ("tenants", 0, "api_key_sha256", 0), "<redacted>"),
        ("y" * 200, (), "'" + "y" * 77 + "...'"),
    ],
)
def test_describe_value(value: object, loc: tuple[str | int, ...], shown: str) -> None:
    assert describe_value(value, loc) == shown


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    count: int = Field(gt=0)
    ratio: float = Field(default=0.5, le=1)


def test_pydantic_errors_become_path_reason_value() -> None:
    with pytest.raises(ValidationError) as info:
        _Model.model_validate({"count": -5, "ratio": 2.5, "extra": 1})
    issues = issues_from_validation(info.value, ("routes", 2), allowed_keys=lambda _: ["count"])
    assert [str(i) for i in issues] == [
        "routes[2].count: must be > 0 (got -5)",
        "routes[2].ratio: must be <= 1 (got 2.5)",
        "routes[2].extra: unknown key (allowed: count)",
    ]


def test_policy_error_message_counts_the_rest() -> None:
    err = PolicyError(["a: bad", "b: worse"])
    assert err.errors == ["a: bad", "b: worse"]
    assert str(err) == "a: bad (and 1 more)"
