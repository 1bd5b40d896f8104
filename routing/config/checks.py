"""Checks that span sections: unique names, plugin parameters, and every cross-reference.

They run after structural validation, on whatever parts of the policy were structurally valid,
and collect every problem instead of stopping at the first. Names of entries that were
structurally invalid count as defined, so one broken tenant does not also produce a "dangling
reference" for every adapter it owns.
"""

from __future__ import annotations

import difflib
import posixpath
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from routing.config.catalog import PluginCatalog
from routing.config.errors import (
    Loc,
    PolicyIssue,
    describe_value,
    issue,
    issues_from_validation,
    unknown_key_hint,
)
from routing.config.policy import Policy
from routing.gone_keys import gone_keys

#: Section name -> names of entries that failed structural validation (see module docstring).
InvalidNames = Mapping[str, set[str]]


def _unknown(what: str, value: str, known: Iterable[str]) -> str:
    """``unknown profile 'x' (did you mean 'y'?; defined: a, b)``."""
    known = sorted(set(known))
    close = difflib.get_close_matches(value, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
    return f"unknown {what} {describe_value(value)} ({hint}defined: {shown or 'none'})"


@dataclass
class _Checker:
    policy: Policy
    catalog: PluginCatalog
    invalid: InvalidNames
    issues: list[PolicyIssue] = field(default_factory=list)
    params: dict[str, BaseModel] = field(default_factory=dict)

    def names(self, section: str, defined: Iterable[str]) -> set[str]:
        return set(defined) | set(self.invalid.get(section, ()))

    def add(self, loc: Loc, reason: str) -> None:
        self.issues.append(issue(loc, reason))

    # ------------------------------------------------------------------ unique names

    def unique(self, section: str, names: Sequence[str], key: str = "name") -> None:
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            if name in first:
                self.add(
                    (section, i, key),
                    f"duplicate name {name!r} (also {section}[{first[name]}])",
                )
            else:
                first[name] = i

    def check_unique_names(self) -> None:
        p = self.policy
        self.unique("replica_pools", [x.name for x in p.replica_pools])
        self.unique("models", [x.name for x in p.models])
        self.unique("routes", [x.name for x in p.routes])
        self.unique("plugins", [x.ref_name for x in p.plugins])
        self.unique("profiles", [x.name for x in p.profiles])
        self.unique("tenants", [x.name for x in p.tenants])
        self.unique("adapters", [x.name for x in p.adapters])
        models = {m.name for m in p.models}
        for i, adapter in enumerate(p.adapters):
            if adapter.name in models:
                # vLLM resolves `model` against both; one name for two things is ambiguous.
                self.add(("adapters", i, "name"), f"{adapter.name!r} is also a model name")
        for i, prof in enumerate(p.profiles):
            if prof.name in self.catalog.builtin_profiles:
                self.add(
                    ("profiles", i, "name"),
                    f"{prof.name!r} is a built-in profile; give yours another name",
                )

    # ------------------------------------------------------------------ plugins and profiles

    def check_plugins(self) -> None:
        for i, plugin in enumerate(self.policy.plugins):
            if plugin.type not in self.catalog.plugins:
                self.add(
                    ("plugins", i, "type"),
                    _unknown("plugin type", plugin.type, self.catalog.plugins),
                )
                continue
            model = self.catalog.params_model(plugin.type)
            loc = ("plugins", i, "parameters")
            if model is None:
                if plugin.parameters:
                    self.add(loc, f"plugin type {plugin.type!r} takes no parameters")
                continue
            allowed = {f.alias or n for n, f in model.model_fields.items()}
            unknown = sorted(set(plugin.parameters) - allowed)
            # A removed key gets the model's own hint (what replaced it): the model never sees
            # the unknown keys, which are left out of the validation below.
            gone = gone_keys(model)
            for key in unknown:
                # Checked here too, whatever the Params model's own config says: a typo'd
                # parameter silently left at its default is the classic policy bug.
                hint = unknown_key_hint(key, sorted(allowed)) if allowed else " (it takes none)"
                unknown_reason = f"unknown parameter{hint}"
                self.add((*loc, key), gone.get(key, unknown_reason))
            known = {k: v for k, v in plugin.parameters.items() if k in allowed}
            try:
                params = model.model_validate(known)
            except ValidationError as exc:
                self.issues.extend(issues_from_validation(exc, loc))
                continue
            if not unknown:
                self.params[plugin.ref_name] = params

    def _plugin_kind(self, ref: str, loc: Loc) -> str | None:
        """Kind of the plugin a profile refers to; reports dangling refs. None: unknown/skip."""
        declared = self.policy.plugin(ref)
        if declared is not None:
            return self.catalog.kind_of(declared.type)
        if ref in self.invalid.get("plugins", ()):
            return None
        if ref in self.catalog.plugins:
            # A bare type name: an implicit instance with default parameters.
            model = self.catalog.params_model(ref)
            if model is not None:
                try:
                    model.model_validate({})
                except ValidationError:
                    self.add(loc, f"plugin type {ref!r} needs parameters; declare it in plugins")
                    return None
            return self.catalog.kind_of(ref)
        known = {p.ref_name for p in self.policy.plugins} | set(self.catalog.plugins)
        self.add(loc, _unknown("plugin", ref, known))
        return None

    def _expect_kind(self, ref: str, loc: Loc, want: str) -> None:
        kind = self._plugin_kind(ref, loc)
        if kind is not None and kind != want:
            self.add(loc, f"plugin {ref!r} is a {kind}, not a {want}")

    def check_profiles(self) -> None:
        for i, prof in enumerate(self.policy.profiles):
            for j, ref in enumerate(prof.filters):
                self._expect_kind(ref, ("profiles", i, "filters", j), "filter")
            for j, scorer in enumerate(prof.scorers):
                self._expect_kind(scorer.ref, ("profiles", i, "scorers", j, "ref"), "scorer")
            self._expect_kind(prof.picker, ("profiles", i, "picker"), "picker")

    # ------------------------------------------------------------------ routes

    def check_routes(self) -> None:
        p = self.policy
        profiles = self.names("profiles", (x.name for x in p.profiles))
        targets = self.names("models", (m.name for m in p.models)) | self.names(
            "adapters", (a.name for a in p.adapters)
        )
        tenants = self.names("tenants", (t.name for t in p.tenants))
        catch_all: int | None = None
        for i, route in enumerate(p.routes):
            if route.profile not in profiles and route.profile not in self.catalog.builtin_profiles:
                self.add(
                    ("routes", i, "profile"),
                    _unknown("profile", route.profile, profiles | self.catalog.builtin_profiles),
                )
            if route.match.model is not None and route.match.model not in targets:
                self.add(
                    ("routes", i, "match", "model"),
                    _unknown("model or adapter", route.match.model, targets),
                )
            if route.match.tenant is not None and route.match.tenant not in tenants:
                self.add(
                    ("routes", i, "match", "tenant"),
                    _unknown("tenant", route.match.tenant, tenants),
                )
            if catch_all is not None:
                self.add(
                    ("routes", i),
                    f"unreachable: routes[{catch_all}] ({p.routes[catch_all].name!r}) matches "
                    f"every request before it",
                )
            elif route.match.is_catch_all:
                catch_all = i

    # ------------------------------------------------------------------ fleet

    def check_models(self) -> None:
        p = self.policy
        pools = self.names("replica_pools", (x.name for x in p.replica_pools))
        for i, model in enumerate(p.models):
            for j, pool_name in enumerate(model.pools):
                if pool_name not in pools:
                    self.add(("models", i, "pools", j), _unknown("pool", pool_name, pools))
            sizes = {
                pool.name: pool.block_size
                for name in model.pools
                if (pool := p.pool(name)) is not None
            }
            if model.block_size is not None:
                for pool_name, size in sizes.items():
                    if size != model.block_size:
                        self.add(
                            ("models", i, "block_size"),
                            f"block_size {model.block_size} differs from pool {pool_name!r} "
                            f"block_size {size}; prefix hashes would never match",
                        )
            elif len(set(sizes.values())) > 1:
                listed = ", ".join(f"{k}={v}" for k, v in sizes.items())
                self.add(
                    ("models", i, "pools"),
                    f"pools disagree on block_size ({listed}); set the same block_size on each",
                )

    def check_prices(self) -> None:
        p = self.policy
        pools = self.names("replica_pools", (x.name for x in p.replica_pools))
        for name, price in p.prices.gpu_per_hour.items():
            loc = ("prices", "gpu_per_hour", name)
            if name not in pools:
                self.add(loc, _unknown("pool", name, pools))
                continue
            pool = p.pool(name)
            own = pool.gpu_price_per_hour if pool is not None else None
            if own is not None and own != price:
                self.add(
                    loc,
                    f"price {price} conflicts with replica_pools {name!r} "
                    f"gpu_price_per_hour {own}; set it in one place",
                )

    # ------------------------------------------------------------------ tenancy

    def check_adapters(self) -> None:
        p = self.policy
        models = self.names("models", (m.name for m in p.models))
        tenants = self.names("tenants", (t.name for t in p.tenants))
        for i, adapter in enumerate(p.adapters):
            if adapter.base_model not in models:
                self.add(
                    ("adapters", i, "base_model"), _unknown("model", adapter.base_model, models)
                )
            for j, owner in enumerate(adapter.owners):
                if owner not in tenants:
                    self.add(("adapters", i, "owners", j), _unknown("tenant", owner, tenants))
        self._check_storage_roots(tenants)
        self._check_pinned_fit()

    def _check_storage_roots(self, tenants: set[str]) -> None:
        """``adapter_storage`` names known tenants, and every file adapter's local source lies
        under its owners' roots (the rule ``adapters_registry.paths.StorageRoots`` applies to
        admin additions too)."""
        p = self.policy
        storage = p.adapter_storage
        for name in storage.tenants:
            if name not in tenants:
                self.add(("adapter_storage", "tenants", name), _unknown("tenant", name, tenants))
        if not storage.configured:
            return
        for i, adapter in enumerate(p.adapters):
            path = _local_path(adapter.source)
            if path is None:
                continue
            for owner in adapter.owners or [None]:
                roots = storage.roots_for(owner)
                who = f"tenant {owner!r}" if owner is not None else "adapters without owners"
                if not roots:
                    self.add(
                        ("adapters", i, "source"),
                        f"no adapter_storage roots allow local paths for {who} "
                        f"(give it roots under adapter_storage.tenants, or shared ones)",
                    )
                elif not any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots):
                    self.add(
                        ("adapters", i, "source"),
                        f"{adapter.source!r} is outside the adapter_storage roots of {who} "
                        f"({', '.join(roots)})",
                    )

    def _check_pinned_fit(self) -> None:
        """Pinned adapters of one base model must fit the GPU LoRA slots of its pools."""
        p = self.policy
        pinned = Counter(a.base_model for a in p.adapters if a.pinned)
        for i, model in enumerate(p.models):
            count = pinned.get(model.name, 0)
            if not count:
                continue
            for name in model.pools:
                pool = p.pool(name)
                if pool is not None and pool.max_loras is not None and count > pool.max_loras:
                    self.add(
                        ("models", i, "pools"),
                        f"{count} pinned adapters of {model.name!r} exceed pool {name!r} "
                        f"max_loras {pool.max_loras}; nothing else could ever load",
                    )

    def check_tenants(self) -> None:
        p = self.policy
        adapters = self.names("adapters", (a.name for a in p.adapters))
        owner_of_key: dict[str, str] = {}
        for i, tenant in enumerate(p.tenants):
            for j, name in enumerate(tenant.allowed_adapters):
                if name not in adapters:
                    self.add(
                        ("tenants", i, "allowed_adapters", j), _unknown("adapter", name, adapters)
                    )
            for j, digest in enumerate(tenant.api_key_sha256):
                if digest not in owner_of_key:
                    owner_of_key[digest] = tenant.name
                    continue
                # One key, two identities: authentication would be ambiguous.
                other = owner_of_key[digest]
                where = "listed twice" if other == tenant.name else f"used by tenant {other!r}"
                self.add(("tenants", i, "api_key_sha256", j), f"this key hash is already {where}")
        for j, digest in enumerate(p.admin.api_key_sha256):
            if digest in owner_of_key:
                self.add(
                    ("admin", "api_key_sha256", j),
                    f"this key hash is also tenant {owner_of_key[digest]!r}'s API key; "
                    f"use a separate admin key",
                )
        anonymous = p.gateway.anonymous_tenant
        if anonymous is not None:
            tenants = self.names("tenants", (t.name for t in p.tenants))
            if anonymous not in tenants:
                self.add(("gateway", "anonymous_tenant"), _unknown("tenant", anonymous, tenants))


def _local_path(source: str) -> str | None:
    """The path of a local adapter source (absolute, or ``file:///...``); None for a URI."""
    if source.startswith("/"):
        return posixpath.normpath(source)
    if source.startswith("file://"):
        return posixpath.normpath(urlsplit(source).path)
    return None


def check_policy(
    policy: Policy, catalog: PluginCatalog, invalid_names: InvalidNames | None = None
) -> tuple[list[PolicyIssue], dict[str, BaseModel]]:
    """Every cross-section problem of ``policy``, and the validated plugin parameters by name."""
    checker = _Checker(policy, catalog, invalid_names or {})
    checker.check_unique_names()
    checker.check_plugins()
    checker.check_profiles()
    checker.check_routes()
    checker.check_models()
    checker.check_prices()
    checker.check_adapters()
    checker.check_tenants()
    return checker.issues, checker.params
