"""The plugin registry and the built-in profiles."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from routing.engine import Profile
from routing.policies.base import Plugin
from routing.policies.registry import (
    BUILTIN_PROFILES,
    DEFAULT_PROFILE,
    PLUGINS,
    build_plugin,
    builtin_profile,
    builtin_profiles,
)

POLICIES = [
    "round-robin",
    "random",
    "least-loaded",
    "power-of-two",
    "consistent-hash",
    "cache-aware",
    "expected-ttft",
    "fleet-cost",
]


@pytest.mark.parametrize("type_name", sorted(PLUGINS))
def test_every_plugin_is_registered_under_its_own_name_with_strict_params(type_name: str) -> None:
    cls = PLUGINS[type_name]
    assert issubclass(cls, Plugin)
    assert cls.type_name == type_name
    assert cls.kind in ("filter", "scorer", "picker")
    assert cls.Params.model_config.get("extra") == "forbid"
    method = {"filter": "filter", "scorer": "score", "picker": "pick"}[cls.kind]
    plugin = build_plugin(type_name, {})
    assert callable(getattr(plugin, method))
    assert plugin.name == type_name
    assert cls.__doc__ and getattr(cls, method).__doc__


def test_build_plugin_validates_parameters_and_names_the_bad_one() -> None:
    plugin = build_plugin("max-score", {"tie_tolerance": 0.1}, name="mine")
    assert plugin.params.tie_tolerance == 0.1 and plugin.name == "mine"
    with pytest.raises(ValidationError, match="tie_tolerence"):
        build_plugin("max-score", {"tie_tolerence": 0.1})  # typo: unknown key refused
    with pytest.raises(ValidationError, match="tie_tolerance"):
        build_plugin("max-score", {"tie_tolerance": 1.5})
    with pytest.raises(ValidationError, match="prefix_blocks"):
        build_plugin("consistent-hash", {"prefix_blocks": 0})
    with pytest.raises(ValueError, match="unknown plugin type 'nope' \\(known: cache-aware"):
        build_plugin("nope", {})
    with pytest.raises(ValueError, match="must be a mapping"):
        build_plugin("load", [1, 2])  # type: ignore[arg-type]


def test_plugin_refuses_params_of_another_type() -> None:
    with pytest.raises(TypeError, match="params must be"):
        PLUGINS["max-score"](PLUGINS["consistent-hash"].Params())


@pytest.mark.parametrize(
    ("name", "needs_prefix"),
    [
        ("round-robin", False),
        ("random", False),
        ("least-loaded", False),
        ("power-of-two", False),
        ("consistent-hash", False),  # keys on the chain itself, no index lookup
        ("cache-aware", True),
        ("expected-ttft", True),
        ("fleet-cost", True),
    ],
)
def test_builtin_profiles(name: str, needs_prefix: bool) -> None:
    profile = builtin_profile(name)
    assert isinstance(profile, Profile) and profile.name == name
    assert profile.needs_prefix is needs_prefix
    assert builtin_profile(name).picker is not profile.picker  # fresh state each time


def test_every_policy_is_built_in_and_the_default_is_fleet_cost() -> None:
    assert set(BUILTIN_PROFILES) == set(POLICIES)
    assert set(builtin_profiles()) == set(POLICIES)
    assert DEFAULT_PROFILE == "fleet-cost"
    with pytest.raises(ValueError, match="unknown built-in routing profile 'fastest'"):
        builtin_profile("fastest")
