"""Turn a validated policy's profiles into the engine's ``Profile`` objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from routing.config.catalog import PluginCatalog
from routing.config.plugins import PluginSpec, ProfileSpec


class ProfileDefinitions(Protocol):
    """The part of a validated ``Policy`` this module reads: its profiles and plugin specs.

    A protocol rather than an import of ``Policy``: ``Policy.profiles_for_engine`` calls into
    this module, so naming ``Policy`` here would make the two files an import cycle.
    """

    @property
    def profiles(self) -> Sequence[ProfileSpec]: ...

    def plugin(self, ref: str) -> PluginSpec | None: ...


def _previous_instances(previous: Mapping[str, Any]) -> dict[str, Any]:
    """Plugin instances of the running profiles, by instance name."""
    found: dict[str, Any] = {}
    for profile in previous.values():
        for plugin in getattr(profile, "plugins", ()):
            name = getattr(plugin, "name", None)
            if isinstance(name, str):
                found.setdefault(name, plugin)
    return found


def build_engine_profiles(
    policy: ProfileDefinitions,
    catalog: PluginCatalog | None = None,
    previous: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every built-in profile plus each profile the policy defines, by name.

    Each plugin instance (declared under ``plugins``, or a bare type name) is built once and shared
    by the profiles that name it: an instance is one piece of learned state (a TTFT calibration, a
    round-robin position), and two profiles naming the same instance mean the same state.

    ``previous`` (the running profiles, on a reload) lets that state survive: a plugin whose name,
    type and parameters are unchanged keeps its instance, and built-in profiles are kept as they
    are. Anything changed starts fresh.
    """
    from routing.engine import Profile

    catalog = catalog if catalog is not None else PluginCatalog.from_registry()
    if catalog.build is None or catalog.builtin is None:
        raise ValueError("this plugin catalog cannot build plugins")
    previous = previous or {}
    reusable = _previous_instances(
        {k: v for k, v in previous.items() if k not in catalog.builtin_profiles}
    )
    instances: dict[str, Any] = {}

    def instance(ref: str) -> Any:
        if ref not in instances:
            spec = policy.plugin(ref)
            if spec is not None:
                fresh = catalog.build(spec.type, spec.parameters, spec.ref_name)
            else:
                fresh = catalog.build(ref, {}, ref)
            old = reusable.get(ref)
            same = (
                old is not None
                and type(old) is type(fresh)
                and getattr(old, "params", None) == getattr(fresh, "params", None)
            )
            instances[ref] = old if same else fresh
        return instances[ref]

    profiles: dict[str, Any] = {
        name: previous[name] if name in previous else catalog.builtin(name)
        for name in sorted(catalog.builtin_profiles)
    }
    for spec in policy.profiles:
        profiles[spec.name] = Profile(
            name=spec.name,
            filters=[instance(ref) for ref in spec.filters],
            scorers=[(instance(s.ref), s.weight) for s in spec.scorers],
            picker=instance(spec.picker),
        )
    return profiles
