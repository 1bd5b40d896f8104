"""The validated ``Policy``: look-ups the request path uses, summary, and engine profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from routing.config import DEFAULT_PROFILE, Policy, derive_cache_salt, load_policy, parse_policy
from routing.config.policy import IMPLICIT_ROUTE
from routing.engine import Profile
from tests.unit.test_config_fixtures import BASE, mutate, parse

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "policy.yaml"


@pytest.fixture(scope="module")
def policy() -> Policy:
    doc = mutate(
        "routes",
        [
            *BASE["routes"],
            {
                "name": "batch",
                "match": {"headers": [{"name": "X-Workload", "value": "batch"}]},
                "profile": "builtin-b",
            },
            {"name": "chat", "match": {"path": "/v1/chat/completions"}},
            {"name": "v1", "match": {"path_prefix": "/v1/"}},
        ],
    )
    doc = mutate("replica_pools[0].gpu_price_per_hour", 2.0, doc)
    doc = mutate("replica_pools[0].gpus_per_replica", 4, doc)
    doc = mutate("prices", {"gpu_per_hour": {"pool-b": 3.5}}, doc)
    doc = mutate("tenants[1].cache_salt", "globex-salt-1", doc)
    return parse(doc)


def test_tenant_lookup_by_raw_key_and_by_hash(policy: Policy) -> None:
    acme = policy.tenant_for_api_key("k-acme")
    assert acme is not None and acme.name == "acme"
    assert policy.tenant_for_api_key("k-unknown") is None
    digest = policy.tenants[1].api_key_sha256[0]
    assert policy.tenant_for_key_sha256(digest.upper()) is policy.tenants[1]


def test_cache_salt_is_derived_per_tenant_unless_configured(policy: Policy) -> None:
    acme, globex = policy.tenants
    assert acme.cache_salt is None
    assert acme.effective_cache_salt == derive_cache_salt("acme")
    assert derive_cache_salt("acme") != derive_cache_salt("globex")
    assert globex.effective_cache_salt == "globex-salt-1"


@pytest.mark.parametrize(
    ("path", "model", "tenant", "headers", "route"),
    [
        ("/v1/completions", "ad-1", "globex", {}, "r-adapter"),
        ("/v1/completions", "org/base-m", "acme", {}, "r-tenant"),
        ("/v1/completions", "org/base-m", "globex", {"x-workload": "batch"}, "batch"),
        ("/v1/completions", "org/base-m", "globex", {"x-workload": "other"}, "v1"),
        ("/v1/chat/completions", "org/base-m", "globex", {}, "chat"),
        ("/v1/chat/completions/x", "org/base-m", "globex", {}, "v1"),
        ("/admin", "org/base-m", "globex", {}, IMPLICIT_ROUTE.name),
    ],
)
def test_first_matching_route_wins(
    policy: Policy, path: str, model: str, tenant: str, headers: dict[str, str], route: str
) -> None:
    chosen = policy.match_route(path=path, model=model, tenant=tenant, headers=headers)
    assert chosen.name == route


def test_unmatched_requests_take_the_implicit_default_route(policy: Policy) -> None:
    chosen = policy.match_route(path="/other", model="org/base-m", tenant="acme2", headers={})
    assert chosen is IMPLICIT_ROUTE and chosen.profile == DEFAULT_PROFILE and chosen.slo is None


def test_model_resolution_splits_base_and_adapter(policy: Policy) -> None:
    assert policy.resolve_model("org/base-m") == (policy.models[0], None)
    assert policy.resolve_model("ad-1") == (policy.models[0], policy.adapters[0])
    assert policy.resolve_model("nope") is None


@pytest.mark.parametrize(
    ("tenant", "adapter", "allowed"),
    [
        ("acme", "ad-1", True),  # owner
        ("globex", "ad-1", True),  # allowed_adapters
        ("stranger", "ad-1", False),  # neither
        ("acme", "ad-x", False),  # not catalogued
    ],
)
def test_adapter_permissions(policy: Policy, tenant: str, adapter: str, allowed: bool) -> None:
    assert policy.may_use_adapter(tenant, adapter) is allowed


def test_public_adapters_are_usable_by_anyone() -> None:
    doc = mutate("adapters[0].owners", [])
    doc = mutate("adapters[0].public", True, doc)
    assert parse(doc).may_use_adapter("stranger", "ad-1")


def test_prices_from_pool_or_prices_section(policy: Policy) -> None:
    assert policy.gpu_price_per_hour("pool-a") == 2.0
    assert policy.usd_per_replica_hour("pool-a") == 8.0
    assert policy.gpu_price_per_hour("pool-b") == 3.5
    assert policy.usd_per_replica_hour("pool-b") == 3.5
    assert policy.usd_per_replica_hour("nope") is None


def test_block_size_comes_from_the_model_or_its_pool() -> None:
    doc = mutate("replica_pools[0].block_size", 32)
    policy = parse(mutate("models[1].block_size", 16, doc))
    assert policy.block_size_for("org/base-m") == 32
    assert policy.block_size_for("org/other-m") == 16


def test_summary_counts_each_section(policy: Policy) -> None:
    assert policy.summary() == (
        "policy v1: 2 pools (2 static replicas, 1 with discovery), 2 models, 5 routes, "
        "3 plugins, 1 profile, 2 tenants (2 keys), 1 adapter, index=memory"
    )


def test_policy_is_immutable(policy: Policy) -> None:
    with pytest.raises(ValueError, match="frozen"):
        policy.routes[0].profile = "other"  # type: ignore[misc]


# ----------------------------------------------------------------------- with the real registry


def test_example_policy_builds_engine_profiles() -> None:
    policy = load_policy(EXAMPLE)
    profiles = policy.profiles_for_engine()
    assert {"rag", "adapters-first", "expected-ttft", "round-robin"} <= set(profiles)
    assert all(isinstance(p, Profile) and p.name == name for name, p in profiles.items())
    rag = profiles["rag"]
    assert [(s.name, w) for s, w in rag.scorers] == [
        ("ttft-rag", 3.0),
        ("prefix", 1.0),
        ("kv", 0.5),
    ]
    assert rag.picker.name == "best" and [f.name for f in rag.filters] == ["serving"]
    # The declared parameters reach the plugin instance.
    assert rag.scorers[0][0].params.kv_threshold == 0.85
    # One declared instance is shared by the profiles naming it (one calibration, one state).
    assert profiles["adapters-first"].picker is rag.picker
    # Without the running profiles, every instance is new.
    assert policy.profiles_for_engine()["rag"].picker is not rag.picker


def test_reload_keeps_plugin_state_only_for_unchanged_plugins() -> None:
    text = EXAMPLE.read_text()
    running = parse_policy(text).profiles_for_engine()
    changed = text.replace("kv_threshold: 0.85", "kv_threshold: 0.8")
    assert changed != text
    reloaded = parse_policy(changed).profiles_for_engine(previous=running)
    old_rag, new_rag = running["rag"], reloaded["rag"]
    assert new_rag.picker is old_rag.picker  # unchanged: same instance
    assert new_rag.scorers[1][0] is old_rag.scorers[1][0]  # "prefix", unchanged
    assert new_rag.scorers[0][0] is not old_rag.scorers[0][0]  # "ttft-rag", new parameters
    assert new_rag.scorers[0][0].params.kv_threshold == 0.8
    assert reloaded["round-robin"] is running["round-robin"]  # built-ins keep their state


def test_example_policy_uses_every_section() -> None:
    policy = load_policy(EXAMPLE)
    assert len(policy.replica_pools) >= 2 and len(policy.models) >= 2
    assert any(r.match.headers for r in policy.routes)
    assert any(r.slo is not None for r in policy.routes)
    assert any(s.weight != 1 for p in policy.profiles for s in p.scorers)
    assert any(t.cache_salt for t in policy.tenants) and any(t.rate_limit for t in policy.tenants)
    assert any(a.public for a in policy.adapters) and any(a.owners for a in policy.adapters)
    assert any(a.pinned for a in policy.adapters)
    assert policy.prices.gpu_per_hour and policy.index.backend == "redis"
    assert policy.admin.api_key_sha256 and policy.gateway.anonymous_tenant


@pytest.mark.parametrize("salt", ["team/shared-2026", "team@2026-shared", "back\\slash-salt"])
def test_a_salt_vllm_would_refuse_is_refused_when_the_policy_is_read(salt: str) -> None:
    # vLLM's validate_cache_salt refuses '@', '/', '\\' and NUL: every request of the tenant
    # would be a 400 from the engine.
    with pytest.raises(ValueError, match="vLLM refuses such a salt"):
        parse(mutate("tenants[1].cache_salt", salt, BASE))
