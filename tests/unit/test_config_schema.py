"""Structural validation: strict types, unknown keys, ranges, and the error text an SRE sees."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_config_fixtures import DELETE, errors_of, mutate, sha

# (path to change, new value, the error expected: "path: reason (got value)")
CASES: list[tuple[str, Any, str]] = [
    ("routes[0].slo.ttft_p95_ms", -5, "routes[0].slo.ttft_p95_ms: must be > 0 (got -5)"),
    ("routes[0].slo.tpot_p95_ms", 0, "routes[0].slo.tpot_p95_ms: must be > 0 (got 0)"),
    ("routes[0].slo", {}, "routes[0].slo: give ttft_p95_ms and/or tpot_p95_ms (or drop 'slo')"),
    ("routes[0].slo.ttft_p95_ms", "500", "routes[0].slo.ttft_p95_ms: must be a number (got '500')"),
    (
        "routes[0].slo.ttft_p95_ms",
        float("nan"),
        "routes[0].slo.ttft_p95_ms: must be a finite number",
    ),
    (
        "routes[0].slo.ttf_p95_ms",
        5,
        "routes[0].slo.ttf_p95_ms: unknown key; did you mean 'ttft_p95_ms'? "
        "(allowed: ttft_p95_ms, tpot_p95_ms)",
    ),
    (
        "routes[0].matc",
        {},
        "routes[0].matc: unknown key; did you mean 'match'? (allowed: name, match, slo, profile)",
    ),
    (  # a shortening of a key, not a typo: spelling alone suggested 'profiles'
        "pools",
        [],
        "pools: unknown key; did you mean 'replica_pools'? (allowed: version, replica_pools,",
    ),
    (
        "routes[0].match.path",
        "v1/chat",
        "routes[0].match.path: must start with '/' (got 'v1/chat')",
    ),
    (
        "routes[0].match.headers",
        [{"name": "x a", "value": "1"}],
        "routes[0].match.headers[0].name: must be an HTTP header name (got 'x a')",
    ),
    (
        "routes[0].match.headers",
        [{"name": "X-A", "value": 1}],
        "routes[0].match.headers[0].value: must be a string (got 1)",
    ),
    (
        "routes[0].match.headers",
        [{"name": "X-A", "value": "1"}, {"name": "x-a", "value": "2"}],
        "routes[0].match: the same header is matched twice",
    ),
    (
        "routes[0].name",
        "bad name",
        "routes[0].name: must be 1-63 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit (got 'bad name')",
    ),
    ("routes", {"r": 1}, "routes: must be a list (got a mapping)"),
    ("version", 2, "version: must be one of 1 (got 2)"),
    ("version", DELETE, "version: required key is missing"),
    ("replica_pools", [], "replica_pools: must not be empty"),
    (
        "replica_pools[0].block_size",
        "16",
        "replica_pools[0].block_size: must be an integer (got '16')",
    ),
    (
        "replica_pools[0].block_size",
        True,
        "replica_pools[0].block_size: must be an integer (got true)",
    ),
    ("replica_pools[0].block_size", 0, "replica_pools[0].block_size: must be > 0 (got 0)"),
    (
        "replica_pools[0].replicas",
        ["ftp://x"],
        "replica_pools[0].replicas[0]: must be an http:// or https:// URL with a host (got 'ftp://x')",
    ),
    (
        "replica_pools[0].replicas",
        ["http://a:1", "http://a:1"],
        "replica_pools[0]: 'replicas' lists the same URL twice",
    ),
    (
        "replica_pools[0].replicas",
        [],
        "replica_pools[0]: needs static 'replicas', 'discovery', or both",
    ),
    (
        "replica_pools[0].max_cpu_loras",
        1,
        "replica_pools[0]: max_cpu_loras (1) must be >= max_loras (2)",
    ),
    (
        "replica_pools[0].gpu_price_per_hour",
        -1.5,
        "replica_pools[0].gpu_price_per_hour: must be > 0 (got -1.5)",
    ),
    (
        "replica_pools[1].discovery.redis_url",
        "http://redis:6379",
        "replica_pools[1].discovery.redis_url: must be a redis://, rediss:// or unix:// URL",
    ),
    ("models[1].tokenizer", {"kind": "local"}, "models[1].tokenizer: kind 'local' needs 'path'"),
    (
        "models[1].tokenizer",
        {"kind": "text", "path": "/x"},
        "models[1].tokenizer: kind 'text' does not take 'path'",
    ),
    (
        "models[1].tokenizer",
        {"kind": "hf"},
        "models[1].tokenizer.kind: must be one of 'local', 'remote' or 'text' (got 'hf')",
    ),
    (
        "models[1].tokenizer.path",
        "models/other",
        "models[1].tokenizer.path: must be an absolute path (got 'models/other')",
    ),
    ("models[0].pools", [], "models[0].pools: must not be empty"),
    ("models[0].name", "a b", "models[0].name: must be a model name like 'org/model-7b'"),
    # Too long: the limit is in the message (it read as a bad character), the name cut short.
    ("models[0].name", "m" * 300, "1-200 letters, digits, '.', '_', '-', ':' or '/'"),
    (
        "tenants[0].api_key_sha256",
        ["sk-live-123"],
        "tenants[0].api_key_sha256[0]: must be the hex SHA-256 of the key (64 hex characters), "
        "never the key itself",
    ),
    (
        "tenants[0].rate_limit",
        {"requests_per_s": 0},
        "tenants[0].rate_limit.requests_per_s: must be > 0 (got 0)",
    ),
    (
        "tenants[0].rate_limit",
        {"requests_per_s": 5, "burst": 0.5},
        "tenants[0].rate_limit.burst: must be an integer (got 0.5)",
    ),
    ("tenants[0].cache_salt", "short", "tenants[0].cache_salt: must have at least 8 characters"),
    (
        "adapters[0].source",
        "/adapters/../etc/passwd",
        "adapters[0].source: must not contain '..' (got '/adapters/../etc/passwd')",
    ),
    (
        "adapters[0].source",
        "adapters/ad-1",
        "adapters[0].source: must be an absolute path or a URI with scheme",
    ),
    (
        "adapters[0].source",
        "/adapters//ad-1/",
        "adapters[0].source: must be normalised, e.g. '/adapters/ad-1' (got '/adapters//ad-1/')",
    ),
    ("adapters[0].source", "s3://bucket/a/../b", "adapters[0].source: must not contain '..'"),
    ("adapters[0].source", "file://host/x", "adapters[0].source: file:// URIs take no host"),
    ("adapters[0].source", "s3:///x", "adapters[0].source: must name a bucket, repository or host"),
    ("adapters[0].rank", 0, "adapters[0].rank: must be > 0 (got 0)"),
    ("adapters[0].prewarm_replicas", -1, "adapters[0].prewarm_replicas: must be >= 0 (got -1)"),
    ("adapters[0].pinned", "yes", "adapters[0].pinned: must be true or false (got 'yes')"),
    ("adapters[0].owners", [], "adapters[0]: give 'owners' (tenants) or 'public: true'"),
    ("index", {"backend": "redis"}, "index: backend 'redis' needs 'redis_url'"),
    (
        "index",
        {"backend": "etcd"},
        "index.backend: must be one of 'memory' or 'redis' (got 'etcd')",
    ),
    ("index", {"redis_url": "redis://r:6379"}, "index: 'redis_url' is set but backend is 'memory'"),
    ("index", {"speculative_ttl_s": 0}, "index.speculative_ttl_s: must be > 0 (got 0)"),
    ("gateway", {"max_body_bytes": -1}, "gateway.max_body_bytes: must be > 0 (got -1)"),
    (
        "gateway",
        {"connect_timeout_s": 30, "upstream_timeout_s": 10},
        "gateway: connect_timeout_s (30.0) must be <= upstream_timeout_s (10.0)",
    ),
    ("admin", {"api_key_sha256": sha("x")}, "admin.api_key_sha256: must be a list"),
    ("profiles[0].scorers[0].weight", -1, "profiles[0].scorers[0].weight: must be >= 0 (got -1)"),
    (
        "profiles[0].scorers",
        [{"ref": "s"}, {"ref": "s", "weight": 2}],
        "profiles[0]: a scorer is listed twice; give it one weight",
    ),
    ("plugins[0].parameters", [1], "plugins[0].parameters: must be a mapping (got a list)"),
    (
        "prices",
        {"gpu_per_hour": {"bad key": 1.0}},
        "prices.gpu_per_hour['bad key']: must be 1-63 letters",
    ),
    ("surprise", 1, "surprise: unknown key (allowed: version, replica_pools, models, routes"),
]


@pytest.mark.parametrize(("path", "value", "expected"), CASES, ids=[c[2][:60] for c in CASES])
def test_structural_error_names_path_value_and_reason(path: str, value: Any, expected: str) -> None:
    errors = errors_of(mutate(path, value))
    assert any(expected in e for e in errors), errors


def test_every_error_is_collected_not_just_the_first() -> None:
    doc = mutate("routes[0].slo.ttft_p95_ms", -5)
    doc = mutate("adapters[0].rank", 0, doc)
    doc = mutate("gateway", {"max_body_bytes": 0}, doc)
    doc = mutate("tenants[1].allowed_adapters", ["no-such-adapter"], doc)
    errors = errors_of(doc)
    assert len(errors) == 4, errors
    assert any(
        "tenants[1].allowed_adapters[0]: unknown adapter 'no-such-adapter'" in e for e in errors
    )


def test_errors_carry_source_and_line() -> None:
    text = "version: 1\nreplica_pools:\n  - name: a\n    block_size: -1\n"
    errors = errors_of(text)
    assert "<string>:4: replica_pools[0].block_size: must be > 0 (got -1)" in errors
    # A missing key points at its parent's line.
    assert "<string>:1: models: required key is missing" not in errors
    assert any(e.endswith("models: required key is missing") for e in errors)


def test_raw_key_in_a_hash_field_is_never_echoed() -> None:
    errors = errors_of(mutate("tenants[0].api_key_sha256", ["sk-live-SECRET-123"]))
    assert errors and not any("SECRET" in e for e in errors)


def test_password_in_a_redis_url_is_redacted() -> None:
    doc = mutate("index", {"backend": "memory", "redis_url": "http://:hunter2@redis:6379"})
    errors = errors_of(doc)
    assert any("index.redis_url" in e for e in errors), errors
    assert not any("hunter2" in e for e in errors)


def test_bare_path_in_a_match_rejects_both_path_rules() -> None:
    doc = mutate("routes[0].match", {"path": "/v1/x", "path_prefix": "/v1/"})
    assert any(
        "routes[0].match: give 'path' or 'path_prefix', not both" in e for e in errors_of(doc)
    )
