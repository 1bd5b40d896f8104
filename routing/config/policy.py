"""The whole routing policy: the top-level model and the look-ups the request path needs."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr

from routing.config.base import Name, PositiveFloat, StrictModel
from routing.config.catalog import PluginCatalog
from routing.config.fleet import ModelSpec, ReplicaPool
from routing.config.flow import FlowControlSpec
from routing.config.infra import GatewaySettings, IndexSettings
from routing.config.plugins import PluginSpec, ProfileSpec
from routing.config.routes import Route
from routing.config.tenancy import Adapter, AdapterStorage, AdminSettings, Tenant
from routing.redis_clients import has_literal_password

#: The route of requests that match no route in the policy.
IMPLICIT_ROUTE = Route(name="default")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class Prices(StrictModel):
    """Prices for cost accounting (cost per 1M tokens)."""

    #: USD per GPU-hour, by pool name; wins over nothing, conflicts with a pool's own price.
    gpu_per_hour: dict[Name, PositiveFloat] = Field(default_factory=dict)


class Policy(StrictModel):
    """A validated routing policy. Build it with ``load_policy`` / ``parse_policy``.

    Constructing it directly only checks structure; the loaders also validate plugin parameters
    and every cross-reference, so prefer them.
    """

    version: Literal[1]
    replica_pools: list[ReplicaPool] = Field(min_length=1)
    models: list[ModelSpec] = Field(min_length=1)
    routes: list[Route] = Field(default_factory=list)
    plugins: list[PluginSpec] = Field(default_factory=list)
    profiles: list[ProfileSpec] = Field(default_factory=list)
    tenants: list[Tenant] = Field(default_factory=list)
    adapters: list[Adapter] = Field(default_factory=list)
    adapter_storage: AdapterStorage = Field(default_factory=AdapterStorage)
    prices: Prices = Field(default_factory=Prices)
    index: IndexSettings = Field(default_factory=IndexSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    flow_control: FlowControlSpec = Field(default_factory=FlowControlSpec)

    _pools: dict[str, ReplicaPool] = PrivateAttr(default_factory=dict)
    _models: dict[str, ModelSpec] = PrivateAttr(default_factory=dict)
    _adapters: dict[str, Adapter] = PrivateAttr(default_factory=dict)
    _tenants: dict[str, Tenant] = PrivateAttr(default_factory=dict)
    _profiles: dict[str, ProfileSpec] = PrivateAttr(default_factory=dict)
    _plugins: dict[str, PluginSpec] = PrivateAttr(default_factory=dict)
    _tenant_by_key: dict[str, Tenant] = PrivateAttr(default_factory=dict)
    #: Plugin instance name -> its validated ``Params`` (filled by the loader).
    _plugin_params: dict[str, BaseModel] = PrivateAttr(default_factory=dict)
    #: Where the policy was read from, for logs and the admin API.
    _source: str = PrivateAttr(default="<string>")

    def model_post_init(self, context: Any, /) -> None:
        """Index every section by name once, so per-request look-ups are dict reads."""
        # setdefault keeps the first of duplicate names; the loader reports duplicates as errors.
        for pool in self.replica_pools:
            self._pools.setdefault(pool.name, pool)
        for model in self.models:
            self._models.setdefault(model.name, model)
        for adapter in self.adapters:
            self._adapters.setdefault(adapter.name, adapter)
        for profile in self.profiles:
            self._profiles.setdefault(profile.name, profile)
        for plugin in self.plugins:
            self._plugins.setdefault(plugin.ref_name, plugin)
        for tenant in self.tenants:
            self._tenants.setdefault(tenant.name, tenant)
            for digest in tenant.api_key_sha256:
                self._tenant_by_key.setdefault(digest, tenant)

    # ------------------------------------------------------------------ look-ups by name

    @property
    def source(self) -> str:
        """File (or ``<string>``) the policy was parsed from."""
        return self._source

    def pool(self, name: str) -> ReplicaPool | None:
        """The replica pool called ``name``."""
        return self._pools.get(name)

    def model(self, name: str) -> ModelSpec | None:
        """The base model called ``name``."""
        return self._models.get(name)

    def adapter(self, name: str) -> Adapter | None:
        """The catalogued adapter called ``name``."""
        return self._adapters.get(name)

    def tenant(self, name: str) -> Tenant | None:
        """The tenant called ``name``."""
        return self._tenants.get(name)

    def profile(self, name: str) -> ProfileSpec | None:
        """The user-defined profile called ``name`` (built-ins are not listed here)."""
        return self._profiles.get(name)

    def plugin(self, ref: str) -> PluginSpec | None:
        """The declared plugin instance that profiles call ``ref``."""
        return self._plugins.get(ref)

    def plugin_params(self, ref: str) -> BaseModel | None:
        """Validated ``Params`` of plugin instance ``ref`` (set by the loader)."""
        return self._plugin_params.get(ref)

    # ------------------------------------------------------------------ request-path helpers

    def tenant_for_key_sha256(self, digest: str) -> Tenant | None:
        """The tenant owning the API key whose hex SHA-256 is ``digest``."""
        return self._tenant_by_key.get(digest.lower())

    def tenant_for_api_key(self, api_key: str) -> Tenant | None:
        """The tenant that a raw API key (``Authorization: Bearer …``) authenticates as."""
        return self.tenant_for_key_sha256(hashlib.sha256(api_key.encode()).hexdigest())

    def resolve_model(self, name: str) -> tuple[ModelSpec, Adapter | None] | None:
        """Split a client's ``model`` into (base model, adapter or None); None if unknown."""
        if (model := self._models.get(name)) is not None:
            return model, None
        if (adapter := self._adapters.get(name)) is not None:
            base = self._models.get(adapter.base_model)
            if base is not None:
                return base, adapter
        return None

    def may_use_adapter(self, tenant: str, adapter: str) -> bool:
        """True if ``tenant`` may send requests to ``adapter``.

        Allowed when the adapter is public, the tenant owns it, or the tenant lists it in
        ``allowed_adapters``.
        """
        entry = self._adapters.get(adapter)
        if entry is None:
            return False
        if entry.public or tenant in entry.owners:
            return True
        who = self._tenants.get(tenant)
        return who is not None and adapter in who.allowed_adapters

    def match_route(
        self, *, path: str, model: str, tenant: str, headers: Mapping[str, str]
    ) -> Route:
        """First route (in file order) whose match the request meets.

        A request that matches no route takes ``IMPLICIT_ROUTE`` (name ``default``, the default
        profile, no SLO): routes choose how to route, they never refuse traffic.
        ``headers`` must be keyed by lower-case name (aiohttp's ``CIMultiDict`` works as is).
        """
        for route in self.routes:
            if route.match.matches(path=path, model=model, tenant=tenant, headers=headers):
                return route
        return IMPLICIT_ROUTE

    def block_size_for(self, model: str) -> int:
        """Hashing block size for a base model: its own, else its first pool's."""
        spec = self._models[model]
        if spec.block_size is not None:
            return spec.block_size
        return self._pools[spec.pools[0]].block_size

    def gpu_price_per_hour(self, pool: str) -> float | None:
        """USD per GPU-hour of ``pool`` (from the pool or the ``prices`` section)."""
        entry = self._pools.get(pool)
        if entry is not None and entry.gpu_price_per_hour is not None:
            return entry.gpu_price_per_hour
        return self.prices.gpu_per_hour.get(pool)

    def usd_per_replica_hour(self, pool: str) -> float | None:
        """USD per hour of one replica of ``pool`` (GPU price times GPUs per replica)."""
        price = self.gpu_price_per_hour(pool)
        entry = self._pools.get(pool)
        if price is None or entry is None:
            return None
        return price * entry.gpus_per_replica

    # ------------------------------------------------------------------ reporting

    def summary(self) -> str:
        """One line of counts, for logs and ``fleetgate policy validate``."""
        static = sum(len(p.replicas) for p in self.replica_pools)
        discovered = sum(1 for p in self.replica_pools if p.discovery is not None)
        keys = sum(len(t.api_key_sha256) for t in self.tenants)
        parts = [
            f"{_count(len(self.replica_pools), 'pool')} ({_count(static, 'static replica')}, "
            f"{discovered} with discovery)",
            _count(len(self.models), "model"),
            _count(len(self.routes), "route"),
            _count(len(self.plugins), "plugin"),
            _count(len(self.profiles), "profile"),
            f"{_count(len(self.tenants), 'tenant')} ({_count(keys, 'key')})",
            _count(len(self.adapters), "adapter"),
            f"index={self.index.backend}",
        ]
        return f"policy v{self.version}: " + ", ".join(parts)

    def redis_urls(self) -> dict[str, str]:
        """Every Redis URL the file names, by where (``index.redis_url``, ...)."""
        urls = {
            f"replica_pools[{i}].discovery.redis_url": pool.discovery.redis_url
            for i, pool in enumerate(self.replica_pools)
            if pool.discovery is not None
        }
        if self.index.redis_url is not None:
            urls["index.redis_url"] = self.index.redis_url
        return urls

    def warnings(self) -> list[str]:
        """Valid but probably unintended settings, for ``fleetgate policy validate`` and the
        gateway's log at every (re)load."""
        found = []
        keys = sum(len(t.api_key_sha256) for t in self.tenants)
        if self.tenants and not keys and self.gateway.anonymous_tenant is None:
            found.append(
                f"tenants: {_count(len(self.tenants), 'tenant')} but no API key "
                "(api_key_sha256) and no gateway.anonymous_tenant: every request is refused "
                "with 401 (a policy that declares tenants never falls back to open access)"
            )
        for i, model in enumerate(self.models):
            spec = model.tokenizer
            if spec.kind == "local" and spec.path is not None and not _has_tokenizer(spec.path):
                found.append(
                    f"models[{i}] ({model.name}): tokenizer path {spec.path} has no "
                    "tokenizer.json on this machine. Fine if validation runs elsewhere, but the "
                    "gateway that loads this policy refuses to start without it: mount the model "
                    "files there, or use {kind: remote, url: <engine URL>}"
                )
        for where, url in self.redis_urls().items():
            if has_literal_password(url):
                # Name the variable after the password that is written out.
                name = "REDIS_PASSWORD"
                query = url.partition("?")[2]
                if not has_literal_password(url.split("?")[0]) and "&password=" not in f"&{query}":
                    name = "SENTINEL_PASSWORD" if "sentinel_password=" in url else "KEY_PASSPHRASE"
                found.append(
                    f"{where}: a password written in the file (a ConfigMap anyone with read "
                    f"access sees): write ${{{name}}} there and set {name} in the "
                    "gateway's environment (e.g. from a Secret)"
                )
        return found

    def profiles_for_engine(
        self,
        catalog: PluginCatalog | None = None,
        previous: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Engine ``Profile`` objects by name, built via the plugin registry.

        Keys: every built-in profile plus each user-defined one. Profiles naming the same plugin
        share its instance. On a reload pass the running profiles as ``previous``: plugins whose
        name, type and parameters are unchanged keep their instance (and learned state, such as
        the TTFT calibration); everything else is built fresh.
        """
        from routing.config.engine_profiles import build_engine_profiles

        return build_engine_profiles(self, catalog, previous)


def _has_tokenizer(path: str) -> bool:
    """Whether a ``local`` tokenizer's directory holds the ``tokenizer.json`` it loads."""
    return (Path(path) / "tokenizer.json").is_file()
