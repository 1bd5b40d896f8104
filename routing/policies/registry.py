"""The one place plugin types and built-in profiles are registered by name.

The policy YAML refers to plugins by ``type`` (a key of ``PLUGINS``); ``build_plugin`` validates
their ``parameters`` strictly through the type's ``Params`` model. ``builtin_profile`` gives the
ready-made policies (``fleet-cost``, ``expected-ttft``, ``round-robin`` …) so a gateway runs
without any YAML.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from routing.engine import Profile
from routing.policies import (
    cache_aware,
    consistent_hash,
    expected_ttft,
    fleet_cost,
    least_loaded,
    power_of_two,
    random_choice,
    round_robin,
)
from routing.policies.base import Plugin
from routing.policies.cache_aware import CacheAwarePicker
from routing.policies.consistent_hash import ConsistentHashPicker
from routing.policies.expected_ttft import ExpectedTtftScorer
from routing.policies.fleet_cost import FleetCostScorer
from routing.policies.kv_pressure import KvPressureScorer
from routing.policies.least_loaded import LeastLoadedPicker
from routing.policies.load import LoadScorer
from routing.policies.lora_affinity import LoraAffinityScorer
from routing.policies.max_score import MaxScorePicker
from routing.policies.power_of_two import PowerOfTwoPicker
from routing.policies.prefix_affinity import PrefixAffinityScorer
from routing.policies.random_choice import RandomPicker
from routing.policies.requires_kernels import RequiresKernelsFilter
from routing.policies.round_robin import RoundRobinPicker
from routing.policies.serves_model import ServesModelFilter

__all__ = [
    "BUILTIN_PROFILES",
    "DEFAULT_PROFILE",
    "PLUGINS",
    "build_plugin",
    "builtin_profile",
    "builtin_profiles",
]

#: Plugin type name -> class. Each class has ``type_name``, ``kind`` and a strict ``Params``.
PLUGINS: dict[str, type[Plugin]] = {
    cls.type_name: cls
    for cls in (
        # filters
        ServesModelFilter,
        RequiresKernelsFilter,
        # scorers
        ExpectedTtftScorer,
        FleetCostScorer,
        PrefixAffinityScorer,
        LoraAffinityScorer,
        LoadScorer,
        KvPressureScorer,
        # pickers
        MaxScorePicker,
        RoundRobinPicker,
        RandomPicker,
        LeastLoadedPicker,
        PowerOfTwoPicker,
        ConsistentHashPicker,
        CacheAwarePicker,
    )
}

#: Built-in profile name -> factory of a fresh profile (fresh plugin instances and state).
BUILTIN_PROFILES: dict[str, Callable[[], Profile]] = {
    "fleet-cost": fleet_cost.profile,
    "expected-ttft": expected_ttft.profile,
    "cache-aware": cache_aware.profile,
    "consistent-hash": consistent_hash.profile,
    "power-of-two": power_of_two.profile,
    "least-loaded": least_loaded.profile,
    "round-robin": round_robin.profile,
    "random": random_choice.profile,
}

#: The profile a route uses when it names none.
DEFAULT_PROFILE = "fleet-cost"


def build_plugin(
    type_name: str, params: Mapping[str, Any] | None = None, *, name: str | None = None
) -> Plugin:
    """A plugin of registered type ``type_name`` with validated ``params``.

    Raises ``ValueError`` for an unknown type or non-mapping params, and pydantic's
    ``ValidationError`` (which names the bad parameter) for invalid or unknown parameters.
    """
    cls = PLUGINS.get(type_name)
    if cls is None:
        known = ", ".join(sorted(PLUGINS))
        raise ValueError(f"unknown plugin type {type_name!r} (known: {known})")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(
            f"parameters of plugin {type_name!r} must be a mapping (got {type(params).__name__})"
        )
    return cls(cls.Params.model_validate(dict(params)), name=name)


def builtin_profile(name: str) -> Profile:
    """A fresh instance of the built-in profile ``name`` (e.g. ``"expected-ttft"``)."""
    factory = BUILTIN_PROFILES.get(name)
    if factory is None:
        known = ", ".join(BUILTIN_PROFILES)
        raise ValueError(f"unknown built-in routing profile {name!r} (known: {known})")
    return factory()


def builtin_profiles() -> dict[str, Profile]:
    """Fresh instances of every built-in profile, by name."""
    return {name: factory() for name, factory in BUILTIN_PROFILES.items()}
