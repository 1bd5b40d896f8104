"""Security review findings below the HTTP layer: tenants never mean open access, the anonymous
tenant is the declared one, adapter storage roots from the policy, opaque metric labels of
private adapters, and the layout detector's per-cache-domain content hashes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from adapters_registry.catalog import AdapterCatalog
from adapters_registry.errors import InvalidAdapter
from adapters_registry.metrics import LABEL_KEY_ENV, label_key, private_adapter_label
from fleetgate.cli import main
from gateway.layout import LayoutDiagnostics
from gateway.policy_view import GatewayPolicy, from_policy
from routing.config import PolicyError, derive_cache_salt, parse_policy
from routing.contracts import TokenizedPrompt
from routing.hashing import chain_seed, prompt_chain
from tests.unit.test_adapters_fixtures import adapter, make_policy


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy_doc(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "replica_pools": [{"name": "p", "replicas": ["http://127.0.0.1:9"]}],
        "models": [{"name": "m", "pools": ["p"]}],
        "tenants": [
            {"name": "alpha", "api_key_sha256": [sha("sk-a")]},
            {"name": "trial", "rate_limit": {"requests_per_s": 1, "burst": 2}},
        ],
    }
    doc.update(extra)
    return doc


def parse(doc: dict[str, Any]) -> Any:
    return parse_policy(yaml.safe_dump(doc))


# ----------------------------------------------------------------- 1 and 2: tenants and keys


def test_declared_tenants_without_keys_are_not_open_access() -> None:
    doc = policy_doc()
    doc["tenants"][0]["api_key_sha256"] = []
    policy = parse(doc)
    view = from_policy(policy)
    assert not view.open_access
    assert view.tenant_for_key(None) is None
    assert view.tenant_for_key("sk-anything") is None
    assert policy.warnings() and "every request is refused" in policy.warnings()[0]


def test_open_access_only_without_declared_tenants() -> None:
    assert GatewayPolicy.default().open_access
    view = from_policy(parse(policy_doc(tenants=[])))
    assert view.open_access and view.tenant_for_key("x") is not None
    assert parse(policy_doc()).warnings() == []


def test_anonymous_tenant_is_the_declared_tenant() -> None:
    view = from_policy(parse(policy_doc(gateway={"anonymous_tenant": "trial"})))
    anonymous = view.tenant_for_key(None)
    assert anonymous is not None
    assert anonymous.name == "trial"
    assert anonymous.rate_limit_rps == 1 and anonymous.burst == 2
    assert anonymous.cache_salt == derive_cache_salt("trial")
    assert view.tenant_for_key("sk-wrong") is None
    alpha = view.tenant_for_key("sk-a")
    assert alpha is not None and alpha.name == "alpha"


def test_validate_warns_about_a_policy_that_locks_everyone_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = policy_doc()
    doc["tenants"][0]["api_key_sha256"] = []
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["policy", "validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "OK:" in out and "(0 keys)" in out
    assert f"{path}: warning: tenants: 2 tenants but no API key" in err


# ----------------------------------------------------------------- 6: storage roots in the policy


ROOTS = {"shared": ["/adapters/public"], "tenants": {"acme": ["/adapters/acme/"]}}


def _policy_with(adapters: list[dict[str, Any]], storage: dict[str, Any] | None) -> Any:
    policy = make_policy(adapters)
    doc = policy.model_dump(mode="json", exclude_defaults=True)
    if storage is not None:
        doc["adapter_storage"] = storage
    return parse_policy(yaml.safe_dump(doc))


def test_adapter_storage_confines_file_and_admin_adapters() -> None:
    policy = _policy_with([adapter("a")], ROOTS)
    assert policy.adapter_storage.tenants == {"acme": ["/adapters/acme"]}
    catalog = AdapterCatalog(policy)
    with pytest.raises(InvalidAdapter, match="outside the storage roots of tenant 'acme'"):
        catalog.add(adapter("steal", source="/adapters/globex/lora"))
    # Shared by two owners: under a root of each (globex has only the shared ones).
    with pytest.raises(InvalidAdapter, match="outside the storage roots of tenant 'globex'"):
        catalog.add(adapter("g", source="/adapters/acme/x", owners=["globex", "acme"]))
    catalog.add(adapter("ok", source="/adapters/acme/ok"))
    catalog.add(adapter("remote", source="s3://bucket/any"))  # URIs are not confined
    # A reload that narrows the roots drops the runtime additions now outside them.
    narrower = _policy_with([adapter("a")], {"tenants": {"acme": ["/adapters/acme/a"]}})
    assert catalog.update_policy(narrower) == ["ok"]


def test_adapter_storage_is_validated() -> None:
    with pytest.raises(PolicyError) as err:
        _policy_with(
            [adapter("a", source="/adapters/globex/a"), adapter("pub", owners=[], public=True)],
            {"shared": ["/adapters/public"], "tenants": {"acme": ["/adapters/acme"], "nobody": []}},
        )
    text = "\n".join(err.value.errors)
    assert "adapter_storage.tenants.nobody: unknown tenant" in text
    assert "adapters[0].source: '/adapters/globex/a' is outside the adapter_storage roots" in text
    assert "adapters[1].source: '/adapters/acme/pub' is outside" in text
    with pytest.raises(PolicyError, match="must be an absolute path"):
        _policy_with([adapter("a")], {"shared": ["adapters"]})
    with pytest.raises(PolicyError, match=r"must not contain '\.\.'"):
        _policy_with([adapter("a")], {"shared": ["/adapters/../etc"]})


# ----------------------------------------------------------------- 5: opaque metric labels


def test_private_adapters_get_an_opaque_stable_metrics_label() -> None:
    policy = make_policy([adapter("a"), adapter("pub", owners=[], public=True)])
    catalog = AdapterCatalog(policy)
    label = catalog.metrics_label("a")
    assert label.startswith("private-") and len(label) == len("private-") + 12
    assert label == AdapterCatalog(make_policy([adapter("a")])).metrics_label("a")  # stable
    assert catalog.metrics_label("pub") == "pub"
    other = make_policy([adapter("a", source="/adapters/acme/a-v2")])
    assert AdapterCatalog(other).metrics_label("a") != label  # new weights, new series


def test_a_guessed_private_adapter_name_cannot_be_confirmed_from_its_label(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unkeyed, the label was a hash of name and source: a guess following the documented
    # /adapters/<tenant>/<name> layout confirmed it, and its counter showed its traffic.
    monkeypatch.delenv(LABEL_KEY_ENV, raising=False)
    doc = make_policy([adapter("a")]).model_dump(mode="json", exclude_defaults=True)
    for tenant in doc["tenants"]:
        tenant["api_key_sha256"] = [sha(f"sk-{tenant['name']}")]
    policy = parse(doc)
    label = AdapterCatalog(policy).metrics_label("a")
    source = policy.adapter("a").source
    assert label != private_adapter_label("a", source)  # the guess, without the key
    # Keyed with the tenants' API key hashes (alike on every gateway sharing the policy), or
    # with the deployment's own key.
    keys = [d for t in policy.tenants for d in t.api_key_sha256]
    assert keys and label == private_adapter_label("a", source, label_key(keys))
    monkeypatch.setenv(LABEL_KEY_ENV, "deployment secret")
    assert AdapterCatalog(policy).metrics_label("a") == private_adapter_label(
        "a", source, b"deployment secret"
    )


def test_a_label_key_one_tenant_holds_alone_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Only globex has a key (acme is served as the anonymous tenant): derived from globex's key
    # hash alone, the label key let globex confirm acme's adapter names.
    monkeypatch.delenv(LABEL_KEY_ENV, raising=False)
    doc = make_policy([adapter("a")]).model_dump(mode="json", exclude_defaults=True)
    doc["tenants"][1]["api_key_sha256"] = [sha("sk-globex")]
    AdapterCatalog(parse(doc))
    assert any(LABEL_KEY_ENV in r.getMessage() for r in caplog.records)
    caplog.clear()
    doc["admin"] = {"api_key_sha256": [sha("sk-admin")]}  # a secret no tenant holds
    AdapterCatalog(parse(doc))
    assert not any(LABEL_KEY_ENV in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------- 8: layout per cache domain


SHARED = [1000 + i for i in range(64)]  # 4 blocks of 16 tokens of a shared template


def _observe(layout: LayoutDiagnostics, tokens: list[int], salt: str | None) -> None:
    prompt = TokenizedPrompt(token_ids=tokens)
    seed = chain_seed("m", None, salt)
    layout.observe("r", prompt, prompt_chain(prompt, 16, seed), 16, seed=seed)


def test_tenants_sharing_a_template_are_not_a_cache_busting_layout() -> None:
    layout = LayoutDiagnostics(min_requests=5)
    for tenant in range(40):
        for i in range(2):
            _observe(layout, [*SHARED, *([tenant * 10 + i] * 16)], derive_cache_salt(f"t{tenant}"))
    (report,) = layout.reports()
    assert not report.cache_busting_layout
    assert report.content_repeat_after_miss_fraction == 0.0


def test_cache_busting_layout_is_still_found_within_one_tenant() -> None:
    layout = LayoutDiagnostics(min_requests=5)
    for i in range(5):
        _observe(layout, [i] * 16 + SHARED, derive_cache_salt("alpha"))
    (report,) = layout.reports()
    assert report.cache_busting_layout


class _Body:
    """Just enough of an aiohttp request for ``_read_decoded``: its body in chunks."""

    def __init__(self, data: bytes) -> None:
        self.content = self
        self._data = data

    async def iter_chunked(self, n: int) -> Any:
        for i in range(0, len(self._data), n):
            yield self._data[i : i + n]


async def test_raw_deflate_whose_output_ends_on_a_step_limit_is_decoded_whole() -> None:
    # Raw deflate has no trailer: when the last input chunk ends inside a long match, the
    # decoder holds output past the 1 MiB step and must be drained (it was a 400 "truncated").
    import zlib

    from gateway.request_body import _read_decoded

    body = b"a" * 1048663
    encoder = zlib.compressobj(9, zlib.DEFLATED, -15)
    raw = encoder.compress(body) + encoder.flush()
    assert await _read_decoded(_Body(raw), "deflate", 32 << 20) == body  # type: ignore[arg-type]
