"""Shared pieces of the policy-config tests: a tiny fake plugin catalog and a valid base policy.

The fake catalog keeps these tests about the *config* rules (references, kinds, parameters), not
about the parameters of the real plugins, which their own tests cover.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any, ClassVar

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from routing.config import DEFAULT_PROFILE, PluginCatalog, Policy, PolicyError, parse_policy


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FakeFilter:
    kind: ClassVar[str] = "filter"
    Params = _Params


class FakeScorer:
    kind: ClassVar[str] = "scorer"

    class Params(_Params):
        alpha: float = Field(default=1.0, ge=0, le=1)


class FakeNeedsParams:
    kind: ClassVar[str] = "scorer"

    class Params(_Params):
        required_knob: int


class FakePicker:
    kind: ClassVar[str] = "picker"
    Params = _Params


FAKE_CATALOG = PluginCatalog(
    plugins={
        "fake-filter": FakeFilter,
        "fake-scorer": FakeScorer,
        "fake-needs-params": FakeNeedsParams,
        "fake-picker": FakePicker,
    },
    # The default profile is always built in: a route that names none uses it.
    builtin_profiles=frozenset({"builtin-a", "builtin-b", DEFAULT_PROFILE}),
)


def sha(key: str) -> str:
    """Hex SHA-256 of an API key, as the policy stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


BASE: dict[str, Any] = {
    "version": 1,
    "replica_pools": [
        {"name": "pool-a", "replicas": ["http://r0:8000", "http://r1:8000"], "max_loras": 2},
        {"name": "pool-b", "discovery": {"redis_url": "redis://redis:6379/0"}},
    ],
    "models": [
        {"name": "org/base-m", "pools": ["pool-a"]},
        {
            "name": "org/other-m",
            "pools": ["pool-b"],
            "tokenizer": {"kind": "local", "path": "/models/other"},
        },
    ],
    "plugins": [
        {"type": "fake-filter", "name": "f"},
        {"type": "fake-scorer", "name": "s", "parameters": {"alpha": 0.5}},
        {"type": "fake-picker", "name": "p"},
    ],
    "profiles": [
        {"name": "prof", "filters": ["f"], "scorers": [{"ref": "s", "weight": 2}], "picker": "p"},
    ],
    "routes": [
        {
            "name": "r-adapter",
            "match": {"model": "ad-1"},
            "slo": {"ttft_p95_ms": 500},
            "profile": "prof",
        },
        {"name": "r-tenant", "match": {"tenant": "acme"}, "profile": "builtin-a"},
    ],
    "tenants": [
        {"name": "acme", "api_key_sha256": [sha("k-acme")]},
        {"name": "globex", "api_key_sha256": [sha("k-globex")], "allowed_adapters": ["ad-1"]},
    ],
    "adapters": [
        {
            "name": "ad-1",
            "base_model": "org/base-m",
            "source": "/adapters/ad-1",
            "rank": 8,
            "owners": ["acme"],
        },
    ],
}

DELETE = object()
_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def mutate(path: str, value: Any, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A deep copy of ``doc`` (default ``BASE``) with ``path`` (``a[0].b``) set or deleted."""
    out = copy.deepcopy(BASE if doc is None else doc)
    steps: list[str | int] = [int(idx) if idx else key for key, idx in _STEP.findall(path)]
    node: Any = out
    for step in steps[:-1]:
        node = node[step]
    if value is DELETE:
        del node[steps[-1]]
    else:
        node[steps[-1]] = value
    return out


def parse(doc: dict[str, Any]) -> Policy:
    """Dump ``doc`` to YAML and parse it with the fake catalog."""
    return parse_policy(yaml.safe_dump(doc, sort_keys=False), catalog=FAKE_CATALOG)


def errors_of(doc: dict[str, Any] | str) -> list[str]:
    """The error lines a document produces (fails the test if it is valid)."""
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False)
    with pytest.raises(PolicyError) as info:
        parse_policy(text, catalog=FAKE_CATALOG)
    return info.value.errors


def test_base_policy_is_valid() -> None:
    policy = parse(BASE)
    assert [r.name for r in policy.routes] == ["r-adapter", "r-tenant"]


def test_mutate_sets_and_deletes_without_touching_base() -> None:
    changed = mutate("routes[0].slo.ttft_p95_ms", -5)
    assert changed["routes"][0]["slo"]["ttft_p95_ms"] == -5
    assert BASE["routes"][0]["slo"]["ttft_p95_ms"] == 500
    assert "tenants" not in mutate("tenants", DELETE)
