"""The view of the plugin registry that policy validation needs.

Validation goes through this small seam rather than importing the registry directly, so tests can
check reference rules against a tiny fake catalog, and so the registry stays the single place
where plugin types are registered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

#: Kinds a plugin may declare, and the profile slot each fills.
PLUGIN_KINDS = ("filter", "scorer", "picker")


@dataclass(frozen=True)
class PluginCatalog:
    """Registered plugin types and built-in profile names."""

    #: type name -> plugin class (with a pydantic ``Params`` model and a ``kind``).
    plugins: Mapping[str, type]
    builtin_profiles: frozenset[str]
    #: ``build(type_name, parameters, name)`` -> plugin instance.
    build: Callable[[str, Mapping[str, Any], str], Any] | None = None
    #: ``builtin(name)`` -> engine ``Profile``.
    builtin: Callable[[str], Any] | None = None

    @classmethod
    def from_registry(cls) -> PluginCatalog:
        """The catalog of ``routing/policies/registry.py``."""
        from routing.policies import registry

        return cls(
            plugins=dict(registry.PLUGINS),
            builtin_profiles=frozenset(registry.BUILTIN_PROFILES),
            build=lambda type_name, parameters, name: registry.build_plugin(
                type_name, parameters, name=name
            ),
            builtin=registry.builtin_profile,
        )

    def kind_of(self, type_name: str) -> str | None:
        """The kind of a registered type, or None if unknown."""
        cls = self.plugins.get(type_name)
        return None if cls is None else getattr(cls, "kind", None)

    def params_model(self, type_name: str) -> type[BaseModel] | None:
        """The ``Params`` model of a registered type, or None if it takes no parameters."""
        cls = self.plugins.get(type_name)
        model = getattr(cls, "Params", None)
        return model if isinstance(model, type) and issubclass(model, BaseModel) else None
