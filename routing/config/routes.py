"""Routes: which requests a rule takes, the SLO it promises, and the profile that routes them."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field, field_validator, model_validator

from routing.config.base import HeaderName, ModelName, Name, PositiveFloat, StrictModel
from routing.policies.registry import DEFAULT_PROFILE as _REGISTRY_DEFAULT


class HeaderMatch(StrictModel):
    """An HTTP header that must be present with exactly this value (name is case-insensitive)."""

    name: HeaderName
    value: str


class RouteMatch(StrictModel):
    """Conditions a request must all meet; an empty match takes every request."""

    #: Exact request path, e.g. ``/v1/chat/completions``.
    path: str | None = None
    #: Path prefix, e.g. ``/v1/``.
    path_prefix: str | None = None
    #: Base model or adapter name as the client sends it in ``model``.
    model: ModelName | None = None
    tenant: Name | None = None
    headers: list[HeaderMatch] = Field(default_factory=list)

    @field_validator("path", "path_prefix")
    @classmethod
    def _absolute_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"must start with '/' (got {value!r})")
        return value

    @model_validator(mode="after")
    def _one_path_rule(self) -> RouteMatch:
        if self.path is not None and self.path_prefix is not None:
            raise ValueError("give 'path' or 'path_prefix', not both")
        names = [h.name for h in self.headers]
        if len(set(names)) != len(names):
            raise ValueError("the same header is matched twice")
        return self

    @property
    def is_catch_all(self) -> bool:
        """True when this match takes every request."""
        return (
            self.path is None
            and self.path_prefix is None
            and self.model is None
            and self.tenant is None
            and not self.headers
        )

    def matches(self, *, path: str, model: str, tenant: str, headers: Mapping[str, str]) -> bool:
        """True if a request meets every condition.

        ``headers`` must be keyed by lower-case header name (aiohttp's ``CIMultiDict`` also works).
        """
        if self.path is not None and path != self.path:
            return False
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        if self.model is not None and model != self.model:
            return False
        if self.tenant is not None and tenant != self.tenant:
            return False
        return all(headers.get(h.name) == h.value for h in self.headers)


class Slo(StrictModel):
    """Latency objectives (p95) a route promises; goodput counts requests that meet them."""

    ttft_p95_ms: PositiveFloat | None = None
    tpot_p95_ms: PositiveFloat | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> Slo:
        if self.ttft_p95_ms is None and self.tpot_p95_ms is None:
            raise ValueError("give ttft_p95_ms and/or tpot_p95_ms (or drop 'slo')")
        return self


#: The profile a route uses when it names none: the project's headline policy (one name, kept by
#: the policy registry).
DEFAULT_PROFILE = _REGISTRY_DEFAULT


class Route(StrictModel):
    """A routing rule; routes are tried in file order and the first match wins."""

    name: Name
    match: RouteMatch = Field(default_factory=RouteMatch)
    slo: Slo | None = None
    #: A profile from ``profiles`` or a built-in profile name.
    profile: Name = DEFAULT_PROFILE
