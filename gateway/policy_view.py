"""The gateway's view of the routing policy: tenants, routes, adapters, replicas, prices.

``routing/config.load_policy`` owns the YAML schema; this module reads a loaded ``Policy`` into the
few flat, frozen structures the request path needs, so handlers never walk the schema. Without a
policy file the gateway runs ``GatewayPolicy.default(...)``: any API key (or none) is the default
tenant, one route sends every model through one profile.

Access is open (every caller the default tenant) only when no tenant is declared: without a
policy file, or with one that has no ``tenants:``. A policy that declares tenants never falls
open, whatever its keys: a key must match one of them, and a request without a key acts as
``gateway.anonymous_tenant`` (the full tenant, with its salt, rate limit and routes) or is 401.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from routing.config import Policy
from routing.policies.registry import DEFAULT_PROFILE as _REGISTRY_DEFAULT

DEFAULT_TENANT = "default"
DEFAULT_ROUTE = "default"
DEFAULT_PROFILE = _REGISTRY_DEFAULT
#: Objectives a route without an ``slo`` is measured against (docs/metrics.md), so goodput and
#: the TTFT burn-rate alerts have data in every mode: generous interactive-chat targets.
DEFAULT_TTFT_SLO_MS = 2000.0
DEFAULT_TPOT_SLO_MS = 100.0
#: Price of a GPU-hour when none is given (no ``--usd-per-hour``, a pool without a price), so cost
#: per 1M tokens is always reported: an H100's on-demand list price, as in the sims' profiles.
#: Without a policy file a replica counts as one GPU.
DEFAULT_USD_PER_GPU_HOUR = 3.0


@dataclass(frozen=True)
class Tenant:
    """One tenant: who it is, the prefix-cache salt its requests carry, what it may use."""

    name: str
    #: Injected as vLLM's ``cache_salt`` so tenants never share (or time) each other's prefixes.
    cache_salt: str | None = None
    #: Adapters usable beyond the tenant's own and the public ones.
    allowed_adapters: frozenset[str] = frozenset()
    #: Requests per second allowed (token bucket); None = unlimited.
    rate_limit_rps: float | None = None
    burst: int = 1


@dataclass(frozen=True)
class AdapterEntry:
    """A catalogued LoRA adapter: ``model`` names it, ``base_model`` serves it."""

    name: str
    base_model: str
    owners: frozenset[str] = frozenset()
    public: bool = True

    def usable_by(self, tenant: Tenant) -> bool:
        """True if ``tenant`` may use this adapter."""
        return self.public or tenant.name in self.owners or self.name in tenant.allowed_adapters


class RouteMatcher(Protocol):
    """``routing.config.RouteMatch``: conditions on path, model, tenant and headers."""

    def matches(
        self, *, path: str, model: str, tenant: str, headers: Mapping[str, str]
    ) -> bool: ...


@dataclass(frozen=True)
class Route:
    """A route: which requests it takes and the policy profile that routes them."""

    name: str
    profile: str = DEFAULT_PROFILE
    #: None matches every request.
    match: RouteMatcher | None = None
    ttft_slo_ms: float | None = DEFAULT_TTFT_SLO_MS
    tpot_slo_ms: float | None = DEFAULT_TPOT_SLO_MS
    #: The route declares its ``slo`` (the figures above are then its own, not the defaults the
    #: metrics measure against): routing follows only declared objectives.
    slo_declared: bool = False

    def matches(self, path: str, model: str, tenant: str, headers: Mapping[str, str]) -> bool:
        """True if this route takes the request."""
        if self.match is None:
            return True
        return self.match.matches(path=path, model=model, tenant=tenant, headers=headers)


@dataclass(frozen=True)
class PoolSpeeds:
    """What a pool's engines are configured to do, before routing calibrates them: applied to
    its static replicas and to those the replica agents register."""

    prefill_tokens_per_s: float = 10_000.0
    decode_step_ms: float = 30.0
    #: The pool declares ``max_loras: 0`` (engines without ``--enable-lora``): its replicas
    #: have no LoRA slot until an engine reports some, so adapter requests skip them.
    lora_off: bool = False


@dataclass(frozen=True)
class ReplicaSpec:
    """A replica the policy file (or the command line) names statically."""

    replica_id: str
    url: str
    pool: str = "default"
    models: frozenset[str] = frozenset()
    block_size: int = 16
    speeds: PoolSpeeds = PoolSpeeds()


@dataclass(frozen=True)
class GatewayPolicy:
    """Everything the request path reads from the policy, resolved once per (re)load."""

    #: SHA-256 hex of an API key -> tenant.
    tenants_by_key_sha256: Mapping[str, Tenant] = field(default_factory=dict)
    #: Every declared tenant by name, with keys or without (the anonymous one may have none).
    #: Left empty, it is filled from ``tenants_by_key_sha256``. Empty: open access.
    tenants_by_name: Mapping[str, Tenant] = field(default_factory=dict)
    routes: tuple[Route, ...] = (Route(DEFAULT_ROUTE),)
    adapters: Mapping[str, AdapterEntry] = field(default_factory=dict)
    replicas: tuple[ReplicaSpec, ...] = ()
    #: Pool name -> USD per replica-hour (GPU price x GPUs per replica), for cost per 1M tokens.
    pool_usd_per_hour: Mapping[str, float] = field(default_factory=dict)
    #: Pool name -> its configured engine speeds (every replica of it, static or discovered).
    pool_speeds: Mapping[str, PoolSpeeds] = field(default_factory=dict)
    #: Base model -> block size used for hashing its prompts.
    block_sizes: Mapping[str, int] = field(default_factory=dict)
    #: SHA-256 hex of the admin keys the policy accepts (besides ``--admin-key``).
    admin_key_sha256: frozenset[str] = frozenset()
    #: Tenant that requests without an API key act as (policy mode); None answers them 401.
    anonymous_tenant: str | None = None
    #: Base models the policy declares; empty in policy-less mode (replicas say what they serve).
    known_models: frozenset[str] = frozenset()
    #: The loaded ``routing.config.Policy`` (None in default mode); the engine reads profiles here.
    source: Policy | None = None

    def __post_init__(self) -> None:
        if not self.tenants_by_name and self.tenants_by_key_sha256:
            by_name = {t.name: t for t in self.tenants_by_key_sha256.values()}
            object.__setattr__(self, "tenants_by_name", by_name)

    @property
    def open_access(self) -> bool:
        """No tenant declared (no policy file, or one without ``tenants:``): any key, or none,
        is the default tenant. Declared tenants without any key never mean open access."""
        return not self.tenants_by_name

    @classmethod
    def default(
        cls,
        replicas: Iterable[ReplicaSpec] = (),
        profile: str = DEFAULT_PROFILE,
        usd_per_hour: float | None = None,
    ) -> GatewayPolicy:
        """Policy-less mode: one open tenant, one route, replicas from the command line."""
        price = DEFAULT_USD_PER_GPU_HOUR if usd_per_hour is None else usd_per_hour
        prices = {"default": price}
        return cls(
            routes=(Route(DEFAULT_ROUTE, profile=profile),),
            replicas=tuple(replicas),
            pool_usd_per_hour=prices,
        )

    def tenant_for_key(self, api_key: str | None) -> Tenant | None:
        """The tenant an API key authenticates as; None if the key is not accepted."""
        if self.open_access:
            return Tenant(DEFAULT_TENANT)
        if not api_key:
            if self.anonymous_tenant is None:
                return None
            # The declared tenant itself (salt, rate limit, routes); validation guarantees it
            # exists, and a name that does not is refused rather than served without limits.
            return self.tenants_by_name.get(self.anonymous_tenant)
        return self.tenants_by_key_sha256.get(sha256_hex(api_key))

    def route_for(
        self, path: str, model: str, tenant: str, headers: Mapping[str, str]
    ) -> Route | None:
        """First route (in file order) that matches; None if none does."""
        for route in self.routes:
            if route.matches(path, model, tenant, headers):
                return route
        return None

    def resolve_model(self, tenant: Tenant, model: str) -> tuple[str, str | None] | None:
        """``model`` as (base model, adapter) for ``tenant``; None if it may not use it.

        Another tenant's adapter resolves to None exactly like a name that does not exist, so a
        404 never reveals that it does.
        """
        adapter = self.adapters.get(model)
        if adapter is None:
            return model, None
        if not adapter.usable_by(tenant):
            return None
        return adapter.base_model, adapter.name

    def adapters_for(self, tenant: Tenant) -> list[AdapterEntry]:
        """The catalogued adapters ``tenant`` may use."""
        return [a for a in self.adapters.values() if a.usable_by(tenant)]


def sha256_hex(secret: str) -> str:
    """Hex SHA-256 of an API key (the policy stores only these)."""
    return hashlib.sha256(secret.encode()).hexdigest()


# ----------------------------------------------------------------- reading a routing Policy


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """Attribute or key ``name`` of ``obj`` (the schema's pydantic models, or dicts in tests)."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _salt(tenant: Any) -> str | None:
    salt = _get(tenant, "effective_cache_salt")
    return str(salt) if salt is not None else _get(tenant, "cache_salt")


def policy_digest(policy: Policy | None) -> str:
    """16 hex digits of the SHA-256 of what the policy file sets, as validated (formatting and
    comments aside, and nothing the file leaves to defaults): equal on pods that run the same
    file, whatever their fleetgate version (a release that adds or changes a default must not
    set a canary apart). ``defaults`` without a policy file."""
    if policy is None:
        return "defaults"
    return hashlib.sha256(policy.model_dump_json(exclude_unset=True).encode()).hexdigest()[:16]


def from_policy(policy: Policy) -> GatewayPolicy:
    """Read a loaded ``routing.config.Policy`` into the gateway's view."""
    tenants: dict[str, Tenant] = {}
    by_name: dict[str, Tenant] = {}
    for t in _get(policy, "tenants", None) or ():
        limit = _get(t, "rate_limit")
        tenant = Tenant(
            name=str(_get(t, "name")),
            cache_salt=_salt(t),
            allowed_adapters=frozenset(_get(t, "allowed_adapters", None) or ()),
            rate_limit_rps=_get(limit, "requests_per_s"),
            burst=int(_get(limit, "effective_burst", None) or _get(limit, "burst", None) or 1),
        )
        by_name.setdefault(tenant.name, tenant)
        for digest in _get(t, "api_key_sha256", None) or ():
            tenants[str(digest).lower()] = tenant
    routes = []
    for r in _get(policy, "routes", None) or ():
        match = _get(r, "match")
        slo = _get(r, "slo")
        # A route that declares an slo keeps exactly what it declares; one without gets defaults.
        ttft_slo, tpot_slo = (
            (DEFAULT_TTFT_SLO_MS, DEFAULT_TPOT_SLO_MS)
            if slo is None
            else (_get(slo, "ttft_p95_ms"), _get(slo, "tpot_p95_ms"))
        )
        routes.append(
            Route(
                name=str(_get(r, "name")),
                profile=str(_get(r, "profile", DEFAULT_PROFILE) or DEFAULT_PROFILE),
                match=None if match is None or _get(match, "is_catch_all", False) else match,
                ttft_slo_ms=ttft_slo,
                tpot_slo_ms=tpot_slo,
                slo_declared=slo is not None,
            )
        )
    adapters = {}
    for a in _get(policy, "adapters", None) or ():
        name = str(_get(a, "name"))
        adapters[name] = AdapterEntry(
            name=name,
            base_model=str(_get(a, "base_model")),
            owners=frozenset(_get(a, "owners", None) or ()),
            public=bool(_get(a, "public", False)),
        )
    pool_models: dict[str, set[str]] = {}
    block_sizes: dict[str, int] = {}
    for m in _get(policy, "models", None) or ():
        for pool in _get(m, "pools", None) or ():
            pool_models.setdefault(str(pool), set()).add(str(_get(m, "name")))
        if _get(m, "block_size") is not None:
            block_sizes[str(_get(m, "name"))] = int(_get(m, "block_size"))
    replicas = []
    prices: dict[str, float] = {}
    speeds: dict[str, PoolSpeeds] = {}
    for p in _get(policy, "replica_pools", None) or ():
        pool = str(_get(p, "name", "default"))
        price_fn = getattr(policy, "usd_per_replica_hour", None)
        price = price_fn(pool) if callable(price_fn) else _get(p, "gpu_price_per_hour")
        if price is None:
            price = DEFAULT_USD_PER_GPU_HOUR * int(_get(p, "gpus_per_replica", 1) or 1)
        prices[pool] = float(price)
        block_size = int(_get(p, "block_size", 16) or 16)
        speeds[pool] = PoolSpeeds(
            float(_get(p, "prefill_tokens_per_s", 10_000.0)),
            float(_get(p, "decode_step_ms", 30.0)),
            lora_off=_get(p, "max_loras", None) == 0,
        )
        for i, entry in enumerate(_get(p, "replicas", None) or ()):
            # A bare URL's id is its position; a named one's, its name (docs/policy.md).
            name, url = (i, entry) if isinstance(entry, str) else (entry.name, entry.url)
            name = i if name is None else name
            replicas.append(
                ReplicaSpec(
                    replica_id=f"{pool}/{name}",
                    url=str(url).rstrip("/"),
                    pool=pool,
                    models=frozenset(pool_models.get(pool, ())),
                    block_size=block_size,
                    speeds=speeds[pool],
                )
            )
        for model in pool_models.get(pool, ()):
            block_sizes.setdefault(model, block_size)
    admin = _get(policy, "admin")
    return GatewayPolicy(
        tenants_by_key_sha256=tenants,
        tenants_by_name=by_name,
        # A request no route matches takes the implicit route "default" (docs/policy.md).
        routes=(*routes, Route(DEFAULT_ROUTE)),
        adapters=adapters,
        replicas=tuple(replicas),
        pool_usd_per_hour=prices,
        pool_speeds=speeds,
        block_sizes=block_sizes,
        admin_key_sha256=frozenset(_get(admin, "api_key_sha256", None) or ()),
        anonymous_tenant=_get(_get(policy, "gateway"), "anonymous_tenant"),
        known_models=frozenset(str(_get(m, "name")) for m in _get(policy, "models", None) or ()),
        source=policy,
    )
