"""The routing-policy YAML: schema, strict validation, and look-ups for the request path.

``load_policy(path)`` / ``parse_policy(text)`` return a validated, immutable ``Policy`` or raise
``PolicyError`` whose ``errors`` list every problem as ``path: reason (got value)``. See
docs/policy.md for the file format.
"""

from routing.config.catalog import PluginCatalog
from routing.config.errors import PolicyError, PolicyIssue
from routing.config.fleet import (
    Discovery,
    ModelSpec,
    ReplicaPool,
    StaticReplica,
    TokenizerSpec,
)
from routing.config.infra import GatewaySettings, IndexSettings
from routing.config.loader import load_policy, parse_policy
from routing.config.plugins import PluginSpec, ProfileSpec, ScorerRef
from routing.config.policy import IMPLICIT_ROUTE, Policy, Prices
from routing.config.routes import DEFAULT_PROFILE, HeaderMatch, Route, RouteMatch, Slo
from routing.config.tenancy import (
    Adapter,
    AdapterStorage,
    AdminSettings,
    RateLimit,
    Tenant,
    derive_cache_salt,
)

__all__ = [
    "DEFAULT_PROFILE",
    "IMPLICIT_ROUTE",
    "Adapter",
    "AdapterStorage",
    "AdminSettings",
    "Discovery",
    "GatewaySettings",
    "HeaderMatch",
    "IndexSettings",
    "ModelSpec",
    "PluginCatalog",
    "PluginSpec",
    "Policy",
    "PolicyError",
    "PolicyIssue",
    "Prices",
    "ProfileSpec",
    "RateLimit",
    "ReplicaPool",
    "Route",
    "RouteMatch",
    "ScorerRef",
    "Slo",
    "StaticReplica",
    "Tenant",
    "TokenizerSpec",
    "derive_cache_salt",
    "load_policy",
    "parse_policy",
]
