"""The adapter catalog: adapters from the policy YAML plus those added at runtime.

The catalog answers two questions on the request path — which adapters a tenant sees in
``/v1/models`` (``visible_to``) and whether it may use one (``authorize``) — and validates runtime
additions from the admin API with the same schema as the policy file (``routing.config.Adapter``),
plus the checks only the catalog can make: the base model exists, the name is free, and a local
source stays inside its owners' storage roots.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from adapters_registry.errors import AdapterNotFound, InvalidAdapter
from adapters_registry.metrics import LABEL_KEY_ENV, label_key, private_adapter_label
from adapters_registry.paths import StorageRoots, normalise_source
from routing.config import Adapter, Policy
from routing.config.errors import issues_from_validation

log = logging.getLogger(__name__)


def _pydantic_errors(exc: ValidationError) -> list[str]:
    """One line per problem, worded as ``fleetgate policy validate`` words them."""
    return [str(problem) for problem in issues_from_validation(exc)] or ["adapter: invalid"]


class AdapterCatalog:
    """Adapters by name: the policy's, then runtime additions (which never shadow the policy's).

    Not thread-safe; the gateway uses it from its event loop only.
    """

    def __init__(self, policy: Policy, storage_roots: StorageRoots | None = None) -> None:
        #: Roots given in code (``RegistrySettings.storage_roots``) win over the policy's
        #: ``adapter_storage``; without them, the roots follow the policy through reloads.
        self._fixed_roots = storage_roots if storage_roots and storage_roots.configured else None
        self._roots = self._roots_of(policy)
        self._policy = policy
        self._runtime: dict[str, Adapter] = {}
        #: Last label by name, and by (name, source): what ``metrics_label`` gave them.
        self._labels: dict[str | tuple[str, str], str] = {}
        self._label_key = self._label_key_of(policy)
        self._check_policy(policy)

    # ------------------------------------------------------------------ policy and reloads

    @property
    def policy(self) -> Policy:
        """The policy the catalog currently follows."""
        return self._policy

    def update_policy(self, policy: Policy) -> list[str]:
        """Follow a reloaded policy; returns the runtime additions that had to be dropped.

        A runtime addition survives unless the new policy defines an adapter of the same name
        (the file wins) or removed its base model.
        """
        roots = self._roots_of(policy)
        self._check_policy(policy, roots)
        for adapter in self:  # remembered before the names or sources go (``metrics_label``)
            self.metrics_label(adapter.name)
        self._policy = policy
        self._roots = roots
        self._label_key = self._label_key_of(policy)
        dropped = []
        for name, adapter in list(self._runtime.items()):
            if (
                policy.adapter(name) is not None
                or policy.model(adapter.base_model) is None
                or not self._within_roots(adapter)
            ):
                dropped.append(name)
                del self._runtime[name]
        if dropped:
            log.warning("policy reload dropped runtime adapters: %s", ", ".join(dropped))
        return dropped

    def _roots_of(self, policy: Policy) -> StorageRoots:
        if self._fixed_roots is not None:
            return self._fixed_roots
        storage = getattr(policy, "adapter_storage", None)
        if storage is None or not storage.configured:
            return StorageRoots()
        return StorageRoots.build(storage.tenants, storage.shared)

    def _within_roots(self, adapter: Adapter) -> bool:
        try:
            self._roots.check(normalise_source(adapter.source), adapter.owners)
        except ValueError:
            return False
        return True

    def _check_policy(self, policy: Policy, roots: StorageRoots | None = None) -> None:
        # The policy schema checked paths; only storage roots are new here.
        roots = self._roots if roots is None else roots
        for adapter in policy.adapters:
            try:
                roots.check(normalise_source(adapter.source), adapter.owners)
            except ValueError as exc:
                raise InvalidAdapter(adapter.name, [f"source: {exc}"]) from None

    # ------------------------------------------------------------------ look-ups

    def find(self, name: str) -> Adapter | None:
        """The adapter called ``name``, or None (for client answers use ``authorize``)."""
        return self._policy.adapter(name) or self._runtime.get(name)

    def get(self, name: str) -> Adapter:
        """The adapter called ``name``; raises ``AdapterNotFound``."""
        adapter = self.find(name)
        if adapter is None:
            raise AdapterNotFound(name)
        return adapter

    def __iter__(self) -> Iterator[Adapter]:
        yield from self._policy.adapters
        yield from self._runtime.values()

    def __len__(self) -> int:
        return len(self._policy.adapters) + len(self._runtime)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    @staticmethod
    def _label_key_of(policy: Policy) -> bytes:
        """The key of private adapters' labels: every tenant's and the admin's API key hashes
        (unless ``FLEETGATE_ADAPTER_LABEL_KEY`` is set). Where one tenant holds every one of
        them, it knows the key and could confirm another tenant's adapter names: said once."""
        holders = [t.api_key_sha256 for t in policy.tenants if t.api_key_sha256]
        admin = list(policy.admin.api_key_sha256)
        private = any(not a.public for a in policy.adapters)
        if private and not admin and len(holders) < 2 and not os.environ.get(LABEL_KEY_ENV):
            log.warning(
                "private adapters' metric labels are keyed with API key hashes that one tenant "
                "holds alone: it could confirm another tenant's adapter names on /metrics. Set "
                "%s on every gateway (any secret string), or an admin key in the policy",
                LABEL_KEY_ENV,
            )
        return label_key([*(d for keys in holders for d in keys), *admin])

    def metrics_label(self, name: str, source: str | None = None) -> str:
        """The ``adapter`` label of ``name`` on ``/metrics``: its name if public, else an opaque
        ``private-<hex>`` (``adapters_registry.metrics.private_adapter_label``). An adapter no
        longer in the catalog (unloaded after its removal), or its weights from ``source`` that
        a reload replaced, keep the label they had, so loads and unloads of one set of weights
        add up under one label (the LoRA-reload review found a removed public adapter's unloads
        under a ``private-…`` label)."""
        if source is not None:
            known = self._labels.get((name, source))
            if known is not None:
                return known
        adapter = self.find(name)
        if adapter is None:
            return self._labels.get(name) or private_adapter_label(name, "", self._label_key)
        label = name if adapter.public else private_adapter_label(
            name, adapter.source, self._label_key
        )
        if self._labels.get(name) != label or (name, adapter.source) not in self._labels:
            if len(self._labels) > 8192:  # names come from the policy and the admin API
                self._labels.clear()
            self._labels[name] = self._labels[(name, adapter.source)] = label
        return label

    def is_runtime(self, name: str) -> bool:
        """True if ``name`` was added through ``add`` (and can be removed with ``remove``)."""
        return name in self._runtime

    # ------------------------------------------------------------------ tenants

    def may_use(self, tenant: str, name: str) -> bool:
        """True if ``tenant`` may use ``name``: public, owned, or in its ``allowed_adapters``."""
        adapter = self.find(name)
        if adapter is None:
            return False
        if adapter.public or tenant in adapter.owners:
            return True
        who = self._policy.tenant(tenant)
        return who is not None and name in who.allowed_adapters

    def authorize(self, tenant: str, name: str) -> Adapter:
        """The adapter if ``tenant`` may use it; else ``AdapterNotFound``.

        Unknown and forbidden raise the same error with the same text, so a tenant cannot probe
        which adapter names other tenants have.
        """
        if not self.may_use(tenant, name):
            raise AdapterNotFound(name)
        return self.get(name)

    def visible_to(self, tenant: str) -> list[Adapter]:
        """What ``/v1/models`` lists for ``tenant``: its own, the public and the allowed ones."""
        return [a for a in self if self.may_use(tenant, a.name)]

    # ------------------------------------------------------------------ admin changes

    def validate(self, spec: Adapter | Mapping[str, Any]) -> Adapter:
        """A checked, normalised ``Adapter`` from an admin body; raises ``InvalidAdapter``."""
        raw = spec.model_dump() if isinstance(spec, Adapter) else dict(spec)
        name = str(raw.get("name", "<unnamed>"))
        errors: list[str] = []
        source = raw.get("source")
        if isinstance(source, str):
            try:
                raw["source"] = normalise_source(source)
            except ValueError as exc:
                errors.append(f"source: {exc}")
        if errors:
            raise InvalidAdapter(name, errors)
        try:
            adapter = Adapter.model_validate(raw)
        except ValidationError as exc:
            raise InvalidAdapter(name, _pydantic_errors(exc)) from None
        if self._policy.model(adapter.base_model) is None:
            known = ", ".join(m.name for m in self._policy.models)
            errors.append(
                f"base_model: no such base model (got {adapter.base_model!r}; known: {known})"
            )
        if self._policy.model(adapter.name) is not None:
            errors.append(f"name: {adapter.name!r} is a base model's name")
        if self._policy.tenants:
            unknown = [o for o in adapter.owners if self._policy.tenant(o) is None]
            if unknown:
                errors.append(f"owners: unknown tenants {unknown!r}")
        try:
            self._roots.check(adapter.source, adapter.owners)
        except ValueError as exc:
            errors.append(f"source: {exc}")
        if adapter.pinned:
            errors.extend(self._pinned_fit(adapter))
        if errors:
            raise InvalidAdapter(adapter.name, errors)
        return adapter

    def _pinned_fit(self, adapter: Adapter) -> list[str]:
        """A pinned runtime addition must leave its base model's pinned adapters within the
        GPU LoRA slots of every pool serving it, as the policy file's own are checked: past
        them nothing else could ever load there (the file's pinned ones included)."""
        pinned = {a.name for a in self if a.pinned and a.base_model == adapter.base_model}
        count = len(pinned | {adapter.name})
        model = self._policy.model(adapter.base_model)
        problems = []
        for name in model.pools if model is not None else ():
            pool = self._policy.pool(name)
            if pool is not None and pool.max_loras is not None and count > pool.max_loras:
                problems.append(
                    f"pinned: {count} pinned adapters of {adapter.base_model!r} would exceed "
                    f"pool {name!r} max_loras {pool.max_loras}; nothing else could ever load"
                )
        return problems

    def add(self, spec: Adapter | Mapping[str, Any], *, replace: bool = False) -> Adapter:
        """Add (or with ``replace``, update) a runtime adapter; returns the stored entry.

        Raises ``InvalidAdapter`` if it fails validation, collides with a policy adapter, or
        exists already and ``replace`` is false.
        """
        adapter = self.validate(spec)
        if self._policy.adapter(adapter.name) is not None:
            raise InvalidAdapter(adapter.name, ["name: defined in the policy file; edit it there"])
        if adapter.name in self._runtime and not replace:
            raise InvalidAdapter(adapter.name, ["name: already in the catalog"])
        self._runtime[adapter.name] = adapter
        return adapter

    def remove(self, name: str) -> Adapter:
        """Remove a runtime addition; raises ``AdapterNotFound`` or ``InvalidAdapter``.

        The caller (admin API) should then unload it from the replicas via the loader.
        """
        if self._policy.adapter(name) is not None:
            raise InvalidAdapter(name, ["name: defined in the policy file; edit it there"])
        adapter = self._runtime.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(name)
        return adapter
