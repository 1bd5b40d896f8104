"""Who may call the gateway and what they may use: tenants, the LoRA adapter catalog, admins."""

from __future__ import annotations

import hashlib
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from routing.config.base import (
    ModelName,
    Name,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Sha256Hex,
    StrictModel,
    check_local_path,
)
from routing.config.flow import PriorityName, TokenBudgetSpec


class RateLimit(StrictModel):
    """A token bucket: ``requests_per_s`` sustained, up to ``burst`` at once."""

    requests_per_s: PositiveFloat
    burst: PositiveInt | None = None

    @property
    def effective_burst(self) -> int:
        """The bucket size; defaults to one second's worth of requests (at least 1)."""
        return self.burst if self.burst is not None else max(1, int(self.requests_per_s))


def derive_cache_salt(tenant: str) -> str:
    """The default ``cache_salt`` of a tenant: stable across gateways and restarts.

    Derived from the name alone so every gateway replica computes the same salt without shared
    state (a salt that changed on restart would throw away the tenant's cached prefixes). It needs
    no secrecy: the gateway always overwrites any ``cache_salt`` a client sends.
    """
    return hashlib.sha256(f"fleetgate/cache-salt/v1/{tenant}".encode()).hexdigest()[:32]


#: Characters vLLM's ``validate_cache_salt`` refuses in a ``cache_salt``.
VLLM_SALT_FORBIDDEN = frozenset("@/\\\x00")


class Tenant(StrictModel):
    """A customer of the gateway, identified by the SHA-256 of its API keys."""

    name: Name
    #: Hex SHA-256 of each accepted key (several during a rotation); never the raw keys.
    api_key_sha256: list[Sha256Hex] = Field(default_factory=list)
    #: vLLM ``cache_salt`` for this tenant's requests; ``None`` means derived from the name.
    #: Tenants given the same salt deliberately share (and can time) each other's prefixes.
    cache_salt: str | None = Field(default=None, min_length=8, max_length=128)
    #: Adapters this tenant may use beyond those it owns and the public ones.
    allowed_adapters: list[ModelName] = Field(default_factory=list)
    rate_limit: RateLimit | None = None
    #: Flow control class of the tenant's requests (docs/flow-control.md).
    priority: PriorityName = "standard"
    #: May a request pick its own class with the ``x-fleetgate-priority`` header?
    allow_priority_header: bool = False
    #: The tenant's TTFT / TPOT objectives; null: the route's (its ``slo``, else the defaults).
    ttft_slo_ms: PositiveFloat | None = None
    tpot_slo_ms: PositiveFloat | None = None
    #: Share of the gateway queue against other tenants of the same class (weighted fair).
    weight: PositiveFloat = 1.0
    token_budget: TokenBudgetSpec | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_vllm_takes(cls, value: str | None) -> str | None:
        # vLLM refuses these in a salt (a 400 on every request of the tenant's), so refuse
        # them here, where the fix is one edit away.
        if value is not None and any(char in value for char in VLLM_SALT_FORBIDDEN):
            raise ValueError(
                "must not contain '@', '/', '\\' or NUL: vLLM refuses such a salt on every "
                "request (use letters, digits, '-', '_' or '.')"
            )
        return value

    @property
    def effective_cache_salt(self) -> str:
        """The salt to send: the configured one, else the one derived from the name."""
        return self.cache_salt if self.cache_salt is not None else derive_cache_salt(self.name)


#: URI schemes an adapter ``source`` may use besides a plain absolute path.
ADAPTER_SOURCE_SCHEMES = ("file", "s3", "gs", "hf", "http", "https")


#: Why a source with credentials in it is refused (never quoting it: the error is logged).
SOURCE_WITH_CREDENTIALS = (
    "must not carry credentials (user:password@ in the URI): give the engines access through "
    "their own environment (HF_TOKEN, cloud credentials) instead"
)


def _check_adapter_source(value: str) -> str:
    if value.startswith("/"):
        return check_local_path(value)
    parts = urlsplit(value)
    if "@" in parts.netloc:
        raise ValueError(SOURCE_WITH_CREDENTIALS)
    if parts.scheme not in ADAPTER_SOURCE_SCHEMES:
        raise ValueError(
            f"must be an absolute path or a URI with scheme "
            f"{', '.join(ADAPTER_SOURCE_SCHEMES)} (got {value!r})"
        )
    if ".." in parts.path.split("/"):
        raise ValueError(f"must not contain '..' (got {value!r})")
    if parts.scheme == "file":
        if parts.netloc:
            raise ValueError(f"file:// URIs take no host: use file:///abs/path (got {value!r})")
        check_local_path(parts.path)
    elif not parts.netloc:
        raise ValueError(f"must name a bucket, repository or host after '://' (got {value!r})")
    return value


class Adapter(StrictModel):
    """A LoRA adapter in the catalog; clients select it by ``name`` in the ``model`` field."""

    name: ModelName
    base_model: ModelName
    #: Absolute local path, or ``file://``, ``s3://``, ``gs://``, ``hf://``, ``http(s)://`` URI.
    source: str
    rank: PositiveInt
    size_mb: PositiveFloat | None = None
    #: Tenants that own the adapter; owners may always use it.
    owners: list[Name] = Field(default_factory=list)
    #: Usable by every tenant.
    public: bool = False
    #: Never evicted from a replica's GPU LoRA slots once loaded.
    pinned: bool = False
    #: Replicas to load it on ahead of the first request.
    prewarm_replicas: NonNegativeInt = 0

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        return _check_adapter_source(value)

    @model_validator(mode="after")
    def _has_audience(self) -> Adapter:
        if not self.owners and not self.public:
            raise ValueError("give 'owners' (tenants) or 'public: true'; nobody could use it")
        if len(set(self.owners)) != len(self.owners):
            raise ValueError("'owners' lists the same tenant twice")
        return self


def _check_root(value: str) -> str:
    return check_local_path(value.rstrip("/") or "/")


class AdapterStorage(StrictModel):
    """Where adapters' *local* sources may live on the replicas' disks (docs/adapters.md).

    With any root configured, a local ``source`` (file adapters and admin-API additions alike)
    must lie under a root of every owner: a tenant's own ``tenants`` entry, else ``shared``
    (which also holds owner-less public adapters). An owner with neither may load nothing from
    disk. URIs (``s3://``, ``hf://``, ...) are not confined. No roots: any absolute path.
    """

    #: Roots of public adapters without owners, and of owners without an entry of their own.
    shared: list[str] = Field(default_factory=list)
    #: Tenant name -> its roots.
    tenants: dict[Name, list[str]] = Field(default_factory=dict)

    @field_validator("shared")
    @classmethod
    def _shared(cls, roots: list[str]) -> list[str]:
        return [_check_root(root) for root in roots]

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, by_tenant: dict[str, list[str]]) -> dict[str, list[str]]:
        return {name: [_check_root(root) for root in roots] for name, roots in by_tenant.items()}

    @property
    def configured(self) -> bool:
        """True if any root is configured."""
        return bool(self.shared) or any(self.tenants.values())

    def roots_for(self, owner: str | None) -> list[str]:
        """Allowed roots of ``owner`` (None: an adapter without owners)."""
        if owner is None:
            return self.shared
        return self.tenants.get(owner, self.shared)


class AdminSettings(StrictModel):
    """The admin API (reload, drain, index stats); disabled when no key is configured."""

    api_key_sha256: list[Sha256Hex] = Field(default_factory=list)
