"""Cross-reference and cross-section checks: dangling names, plugin kinds, parameters, conflicts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import yaml

from routing.config import DEFAULT_PROFILE, PolicyError, parse_policy
from routing.policies.fleet_cost import FleetCostScorer
from tests.unit.test_config_fixtures import BASE, FAKE_CATALOG, errors_of, mutate, parse, sha

# (path to change, new value, exact error expected after "<string>:LINE: ")
CASES: list[tuple[str, Any, str]] = [
    (
        "routes[0].profile",
        "prfo",
        "routes[0].profile: unknown profile 'prfo' (did you mean 'prof'? defined: "
        + ", ".join(sorted({"builtin-a", "builtin-b", DEFAULT_PROFILE, "prof"}))
        + ")",
    ),
    (
        "routes[0].match.model",
        "ghost",
        "routes[0].match.model: unknown model or adapter 'ghost' (defined: ad-1, org/base-m, "
        "org/other-m)",
    ),
    (
        "routes[1].match.tenant",
        "acne",
        "routes[1].match.tenant: unknown tenant 'acne' "
        "(did you mean 'acme'? defined: acme, globex)",
    ),
    ("profiles[0].filters", ["s"], "profiles[0].filters[0]: plugin 's' is a scorer, not a filter"),
    ("profiles[0].picker", "f", "profiles[0].picker: plugin 'f' is a filter, not a picker"),
    (
        "profiles[0].scorers",
        [{"ref": "p"}],
        "profiles[0].scorers[0].ref: plugin 'p' is a picker, not a scorer",
    ),
    (
        "profiles[0].scorers",
        [{"ref": "nope"}],
        "profiles[0].scorers[0].ref: unknown plugin 'nope' (defined: f, fake-filter, "
        "fake-needs-params, fake-picker, fake-scorer, p, s)",
    ),
    (
        "profiles[0].scorers",
        [{"ref": "fake-needs-params"}],
        "profiles[0].scorers[0].ref: plugin type 'fake-needs-params' needs parameters; declare it "
        "in plugins",
    ),
    (
        "profiles[0].name",
        "builtin-a",
        "profiles[0].name: 'builtin-a' is a built-in profile; give yours another name",
    ),
    (
        "plugins[1].type",
        "fake-scorr",
        "plugins[1].type: unknown plugin type 'fake-scorr' (did you mean 'fake-scorer'? defined: "
        "fake-filter, fake-needs-params, fake-picker, fake-scorer)",
    ),
    ("plugins[1].parameters", {"alpha": 2}, "plugins[1].parameters.alpha: must be <= 1 (got 2)"),
    (
        "plugins[1].parameters",
        {"alhpa": 0.1},
        "plugins[1].parameters.alhpa: unknown parameter; did you mean 'alpha'? (allowed: alpha)",
    ),
    (
        "plugins[0].parameters",
        {"x": 1},
        "plugins[0].parameters.x: unknown parameter (it takes none)",
    ),
    ("plugins[2].name", "f", "plugins[2].name: duplicate name 'f' (also plugins[0])"),
    (
        "models[0].pools",
        ["gpu-farm"],
        "models[0].pools[0]: unknown pool 'gpu-farm' (defined: pool-a, pool-b)",
    ),
    (
        "models[0].block_size",
        32,
        "models[0].block_size: block_size 32 differs from pool 'pool-a' block_size 16; prefix "
        "hashes would never match",
    ),
    (
        "models[1].name",
        "org/base-m",
        "models[1].name: duplicate name 'org/base-m' (also models[0])",
    ),
    (
        "adapters[0].base_model",
        "zzz/unknown",
        "adapters[0].base_model: unknown model 'zzz/unknown' (defined: org/base-m, org/other-m)",
    ),
    (
        "adapters[0].owners",
        ["acme", "initech"],
        "adapters[0].owners[1]: unknown tenant 'initech' (defined: acme, globex)",
    ),
    ("adapters[0].name", "org/base-m", "adapters[0].name: 'org/base-m' is also a model name"),
    (
        "tenants[1].allowed_adapters",
        ["ad-2"],
        "tenants[1].allowed_adapters[0]: unknown adapter 'ad-2' "
        "(did you mean 'ad-1'? defined: ad-1)",
    ),
    (
        "tenants[1].api_key_sha256",
        [sha("k-acme")],
        "tenants[1].api_key_sha256[0]: this key hash is already used by tenant 'acme'",
    ),
    (
        "tenants[0].api_key_sha256",
        [sha("k"), sha("k").upper()],
        "tenants[0].api_key_sha256[1]: this key hash is already listed twice",
    ),
    (
        "admin",
        {"api_key_sha256": [sha("k-globex")]},
        "admin.api_key_sha256[0]: this key hash is also tenant 'globex''s API key; use a separate "
        "admin key",
    ),
    (
        "gateway",
        {"anonymous_tenant": "guest"},
        "gateway.anonymous_tenant: unknown tenant 'guest' (defined: acme, globex)",
    ),
    (
        "prices",
        {"gpu_per_hour": {"h100": 2.0}},
        "prices.gpu_per_hour.h100: unknown pool 'h100' (defined: pool-a, pool-b)",
    ),
]


@pytest.mark.parametrize(("path", "value", "expected"), CASES, ids=[c[2][:60] for c in CASES])
def test_reference_error(path: str, value: Any, expected: str) -> None:
    errors = errors_of(mutate(path, value))
    assert any(e.split(": ", 1)[1] == expected for e in errors), errors


def test_price_set_twice_with_different_values_quotes_both() -> None:
    doc = mutate("replica_pools[0].gpu_price_per_hour", 3.0)
    doc = mutate("prices", {"gpu_per_hour": {"pool-a": 2.0}}, doc)
    assert any(
        "prices.gpu_per_hour.pool-a: price 2.0 conflicts with replica_pools 'pool-a' "
        "gpu_price_per_hour 3.0; set it in one place" in e
        for e in errors_of(doc)
    )


def test_pools_disagreeing_on_block_size_are_refused() -> None:
    doc = mutate("models[0].pools", ["pool-a", "pool-b"])
    doc = mutate("replica_pools[1].block_size", 32, doc)
    assert any(
        "models[0].pools: pools disagree on block_size (pool-a=16, pool-b=32)" in e
        for e in errors_of(doc)
    )


def test_pinned_adapters_must_fit_the_lora_slots() -> None:
    doc = mutate("replica_pools[0].max_loras", 1)
    doc = mutate("replica_pools[0].max_cpu_loras", 4, doc)
    extra = {
        "name": "ad-2",
        "base_model": "org/base-m",
        "source": "/a/2",
        "rank": 8,
        "public": True,
        "pinned": True,
    }
    doc = mutate("adapters", [{**BASE["adapters"][0], "pinned": True}, extra], doc)
    assert any(
        "models[0].pools: 2 pinned adapters of 'org/base-m' exceed pool 'pool-a' max_loras 1" in e
        for e in errors_of(doc)
    )


def test_route_after_a_catch_all_is_unreachable() -> None:
    doc = mutate("routes[0].match", {})
    assert any(
        e.endswith(
            "routes[1]: unreachable: routes[0] ('r-adapter') matches every request before it"
        )
        for e in errors_of(doc)
    )


def test_references_to_an_invalid_entry_are_not_also_reported_as_dangling() -> None:
    # The adapter is broken (rank 0); routes and tenants that name it must not add noise.
    errors = errors_of(mutate("adapters[0].rank", 0))
    assert len(errors) == 1, errors
    assert errors[0].endswith("adapters[0].rank: must be > 0 (got 0)")


def test_references_are_still_checked_when_other_sections_are_broken() -> None:
    doc = mutate("gateway", {"max_body_bytes": "big"})
    doc = mutate("routes[0].profile", "missing", doc)
    errors = errors_of(doc)
    assert any("gateway.max_body_bytes: must be an integer" in e for e in errors)
    assert any("routes[0].profile: unknown profile 'missing'" in e for e in errors)


def test_a_route_may_name_a_builtin_profile_without_defining_it() -> None:
    policy = parse(mutate("routes[0].profile", "builtin-b"))
    assert policy.routes[0].profile == "builtin-b"


def test_a_profile_may_name_a_plugin_type_directly() -> None:
    policy = parse(mutate("profiles[0].scorers", [{"ref": "fake-scorer", "weight": 0.5}]))
    assert policy.profiles[0].scorers[0].ref == "fake-scorer"


def test_validated_plugin_params_are_kept_by_instance_name() -> None:
    params = parse(BASE).plugin_params("s")
    assert params is not None and params.alpha == 0.5  # type: ignore[attr-defined]


def test_a_gone_parameter_gets_its_own_message_not_unknown_parameter() -> None:
    # The migration hint of a removed key (routing/gone_keys.py) is written for whoever runs an
    # old policy through `fleetgate policy validate` or `serve`: the generic "unknown parameter"
    # must not stand in for it.
    catalog = replace(FAKE_CATALOG, plugins={**FAKE_CATALOG.plugins, "fleet-cost": FleetCostScorer})
    doc = mutate(
        "plugins[1]", {"type": "fleet-cost", "name": "s", "parameters": {"evict_threshold": 0.9}}
    )
    with pytest.raises(PolicyError) as info:
        parse_policy(yaml.safe_dump(doc, sort_keys=False), catalog=catalog)
    [error] = info.value.errors
    path, reason = error.split(": ", 1)[1].split(": ", 1)
    assert path == "plugins[1].parameters.evict_threshold"
    assert reason.startswith("evict_threshold is gone: eviction_ms now counts the blocks"), reason
