"""The adapter catalog: tenant authorization, /v1/models visibility, runtime additions, paths."""

from __future__ import annotations

import pytest

from adapters_registry.catalog import AdapterCatalog
from adapters_registry.errors import AdapterNotFound, InvalidAdapter
from adapters_registry.paths import StorageRoots, normalise_source
from tests.unit.test_adapters_fixtures import BASE_MODEL, adapter, make_policy

POLICY = make_policy(
    [
        adapter("acme-a"),
        adapter("acme-shared"),
        adapter("pub", public=True, owners=[], source="/adapters/public/pub"),
        adapter("initech-a", owners=["initech"], source="/adapters/initech/a"),
    ]
)


@pytest.fixture
def catalog() -> AdapterCatalog:
    return AdapterCatalog(POLICY)


@pytest.mark.parametrize(
    ("tenant", "name", "allowed"),
    [
        ("acme", "acme-a", True),  # owner
        ("acme", "pub", True),  # public
        ("globex", "acme-shared", True),  # allowed_adapters
        ("globex", "acme-a", False),  # someone else's
        ("initech", "acme-shared", False),  # allowed for globex only
        ("acme", "initech-a", False),
        ("acme", "no-such-adapter", False),
        ("nobody", "pub", True),  # unknown tenants still see public adapters
        ("nobody", "acme-a", False),
    ],
)
def test_authorize_follows_owner_public_allowed(
    catalog: AdapterCatalog, tenant: str, name: str, allowed: bool
) -> None:
    assert catalog.may_use(tenant, name) is allowed
    if allowed:
        assert catalog.authorize(tenant, name).name == name
    else:
        with pytest.raises(AdapterNotFound):
            catalog.authorize(tenant, name)


def test_forbidden_and_unknown_are_indistinguishable(catalog: AdapterCatalog) -> None:
    with pytest.raises(AdapterNotFound) as forbidden:
        catalog.authorize("globex", "acme-a")
    with pytest.raises(AdapterNotFound) as unknown:
        catalog.authorize("globex", "acme-b")
    envelope = forbidden.value.envelope()["error"]
    assert envelope == {
        "message": "The model `acme-a` does not exist.",
        "type": "NotFoundError",
        "code": "model_not_found",
        "param": "model",
    }
    other = unknown.value.envelope()["error"]
    assert other["message"] == "The model `acme-b` does not exist."
    assert {k: v for k, v in envelope.items() if k != "message"} == {
        k: v for k, v in other.items() if k != "message"
    }
    assert forbidden.value.status == unknown.value.status == 404


@pytest.mark.parametrize(
    ("tenant", "names"),
    [
        ("acme", ["acme-a", "acme-shared", "pub"]),
        ("globex", ["acme-shared", "pub"]),
        ("initech", ["pub", "initech-a"]),
    ],
)
def test_visible_to_lists_own_public_and_allowed(
    catalog: AdapterCatalog, tenant: str, names: list[str]
) -> None:
    assert [a.name for a in catalog.visible_to(tenant)] == names


def test_runtime_add_is_validated_normalised_and_removable(catalog: AdapterCatalog) -> None:
    added = catalog.add(adapter("acme-new", source="/adapters//acme/./new/"))
    assert added.source == "/adapters/acme/new"
    assert catalog.authorize("acme", "acme-new") is added
    assert [a.name for a in catalog.visible_to("acme")][-1] == "acme-new"
    assert catalog.is_runtime("acme-new")
    with pytest.raises(InvalidAdapter, match="already in the catalog"):
        catalog.add(adapter("acme-new"))
    catalog.add(adapter("acme-new", rank=16), replace=True)
    assert catalog.get("acme-new").rank == 16
    assert catalog.remove("acme-new").name == "acme-new"
    with pytest.raises(AdapterNotFound):
        catalog.get("acme-new")


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"base_model": "org/other"}, "base_model: no such base model"),
        ({"owners": ["umbrella"]}, "owners: unknown tenants"),
        ({"source": "/adapters/../etc/passwd"}, "must not contain '..'"),
        ({"source": "relative/path"}, "must be an absolute path or a URI"),
        ({"source": "ftp://host/x"}, "must be an absolute path or a URI"),
        ({"source": "s3://bucket/../other"}, "must not contain '..'"),
        ({"rank": "8"}, "rank"),
        ({"owners": [], "public": False}, "nobody could use it"),
    ],
)
def test_runtime_add_rejects_bad_entries(
    catalog: AdapterCatalog, fields: dict[str, object], error: str
) -> None:
    with pytest.raises(InvalidAdapter, match=error):
        catalog.add(adapter("acme-bad", **fields))
    assert "acme-bad" not in catalog


def test_runtime_add_refuses_a_base_model_name(catalog: AdapterCatalog) -> None:
    entry = adapter("x")
    entry["name"] = BASE_MODEL
    with pytest.raises(InvalidAdapter, match="is a base model's name"):
        catalog.add(entry)


def test_policy_adapters_cannot_be_added_over_or_removed(catalog: AdapterCatalog) -> None:
    with pytest.raises(InvalidAdapter, match="defined in the policy file"):
        catalog.add(adapter("acme-a"))
    with pytest.raises(InvalidAdapter, match="defined in the policy file"):
        catalog.remove("acme-a")


def test_storage_roots_confine_each_owner() -> None:
    roots = StorageRoots.build(
        {"acme": ["/adapters/acme"], "initech": ["/adapters/initech"]},
        shared=["/adapters/public"],
    )
    catalog = AdapterCatalog(POLICY, roots)
    catalog.add(adapter("acme-ok", source="file:///adapters/acme/ok"))
    assert catalog.get("acme-ok").source == "/adapters/acme/ok"
    for source in ("/adapters/initech/a", "/adapters/acme-evil/x", "/adapters"):
        with pytest.raises(InvalidAdapter, match="outside the storage roots of tenant 'acme'"):
            catalog.add(adapter("acme-steal", source=source))
    # Shared between two owners: must be inside both tenants' roots, which no path is.
    with pytest.raises(InvalidAdapter, match="tenant 'initech'"):
        catalog.add(adapter("joint", owners=["acme", "initech"], source="/adapters/acme/j"))
    # Owner-less public adapters use the shared roots; remote URIs are the engine's business.
    with pytest.raises(InvalidAdapter, match="adapters without owners"):
        catalog.add(adapter("pub2", owners=[], public=True, source="/adapters/acme/p"))
    catalog.add(adapter("hub", source="hf://org/lora-repo"))
    assert catalog.get("hub").source == "hf://org/lora-repo"


def test_storage_roots_are_checked_against_the_policy_too() -> None:
    roots = StorageRoots.build({"initech": ["/srv/initech"]}, shared=["/adapters"])
    with pytest.raises(InvalidAdapter, match="initech-a"):
        AdapterCatalog(POLICY, roots)


def test_once_roots_are_configured_an_owner_without_any_may_load_nothing_from_disk() -> None:
    # Only initech has roots and nothing is shared: acme, with none, must not reach initech's.
    roots = StorageRoots.build({"initech": ["/adapters/initech"]})
    with pytest.raises(ValueError, match="no storage roots allow local paths for tenant 'acme'"):
        roots.check("/adapters/initech/secret", ["acme"])
    with pytest.raises(ValueError, match="adapters without owners"):
        roots.check("/adapters/initech/secret", [])
    roots.check("/adapters/initech/secret", ["initech"])
    roots.check("hf://org/repo", ["acme"])  # remote sources are the engine's business


def test_policy_reload_drops_shadowed_runtime_adapters(catalog: AdapterCatalog) -> None:
    catalog.add(adapter("later-in-file"))
    catalog.add(adapter("stays"))
    dropped = catalog.update_policy(make_policy([adapter("later-in-file", rank=4)]))
    assert dropped == ["later-in-file"]
    assert catalog.get("later-in-file").rank == 4 and not catalog.is_runtime("later-in-file")
    assert catalog.is_runtime("stays")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("/a/b", "/a/b"),
        ("/a//b/", "/a/b"),
        ("//a/./b", "/a/b"),
        ("file:///a/b/", "/a/b"),
        ("s3://bucket/key/x", "s3://bucket/key/x"),
        ("hf://org/repo", "hf://org/repo"),
    ],
)
def test_normalise_source(source: str, expected: str) -> None:
    assert normalise_source(source) == expected


@pytest.mark.parametrize(
    "source",
    ["", " /a", "a/b", "/a/../b", "file://host/a", "file:///a/../b", "s3://", "s3:///k",
     "hf://org/../x", "ftp://h/x", "/a\x00b"],
)
def test_normalise_source_refuses(source: str) -> None:
    with pytest.raises(ValueError):
        normalise_source(source)


def test_a_source_with_credentials_is_refused_without_repeating_them(
    catalog: AdapterCatalog,
) -> None:
    secret = "https://svc:ghp_SECRETTOKEN@example.com/org/lora"
    with pytest.raises(InvalidAdapter) as info:
        catalog.add(adapter("leaky", source=secret))
    assert "must not carry credentials" in str(info.value)
    assert "SECRETTOKEN" not in str(info.value)


def test_a_pinned_runtime_adapter_must_fit_the_pools_lora_slots() -> None:
    """As the policy file's own: past max_loras pinned adapters, nothing else could load."""
    catalog = AdapterCatalog(make_policy([adapter("p0", pinned=True)], max_loras=1))
    with pytest.raises(InvalidAdapter, match=r"2 pinned adapters of .* exceed pool 'pool-a' max"):
        catalog.add(adapter("p1", pinned=True))
    catalog.add(adapter("p1"))  # not pinned: fine
