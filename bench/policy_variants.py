"""Policy variants for the benchmarks: a built-in policy with some plugin parameters changed.

``--variant NAME=POLICY:key=value,key=value`` in ``bench.routing_quality`` replays, beside the
built-in policies, the built-in ``POLICY`` whose plugins take the given parameters (each key goes
to every plugin of the profile whose parameters have that field). It is how a default is chosen
with a committed command rather than a private script::

    .venv/bin/python -m bench.routing_quality --trace conversation_trace.jsonl \\
        --variant no-decode=fleet-cost:decode_weight=0 --variant d05=fleet-cost:decode_weight=0.05

Variants are reported like the built-ins but never count as the baseline the default policy is
checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.engine import Profile
from routing.policies.base import Plugin
from routing.policies.registry import BUILTIN_PROFILES, builtin_profile

__all__ = ["PolicyVariant", "parse_variant"]

Value = bool | int | float | str | None


@dataclass(frozen=True)
class PolicyVariant:
    """A built-in profile (``base``) rebuilt under ``name`` with parameter ``overrides``."""

    name: str
    base: str
    overrides: tuple[tuple[str, Value], ...]

    def build(self) -> Profile:
        """A fresh profile: the base's plugins, each rebuilt with the overrides it has fields for.

        Raises ``ValueError`` for a key that no plugin of the base profile takes.
        """
        base = builtin_profile(self.base)
        wanted = dict(self.overrides)
        used: set[str] = set()

        def rebuilt(plugin: Plugin) -> Plugin:
            params_cls = type(plugin).Params
            mine = {k: v for k, v in wanted.items() if k in params_cls.model_fields}
            if not mine:
                return plugin
            used.update(mine)
            # Only what was set, so the fields left at their defaults stay unset (fleet-cost derives
            # some of those from the request's SLOs).
            params = params_cls(**{**plugin.params.model_dump(exclude_unset=True), **mine})
            return type(plugin)(params, name=plugin.name)

        profile = Profile(
            name=self.name,
            filters=tuple(rebuilt(f) for f in base.filters),
            scorers=tuple((rebuilt(s), w) for s, w in base.scorers),
            picker=rebuilt(base.picker),
        )
        unknown = sorted(set(wanted) - used)
        if unknown:
            raise ValueError(
                f"variant {self.name!r}: no plugin of {self.base!r} takes {', '.join(unknown)}"
            )
        return profile


def _value(text: str) -> Value:
    lowered = text.lower()
    if lowered == "none":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text


def parse_variant(spec: str) -> PolicyVariant:
    """``NAME=POLICY:key=value,key=value`` -> a checked ``PolicyVariant``.

    Raises ``ValueError`` saying what is wrong and what the form is.
    """
    form = "the form is NAME=POLICY:key=value[,key=value] (e.g. d05=fleet-cost:decode_weight=0.05)"
    name, sep, rest = spec.partition("=")
    base, colon, assignments = rest.partition(":")
    name, base = name.strip(), base.strip()
    if not sep or not colon or not name or not base:
        raise ValueError(f"--variant {spec!r}: {form}")
    if name in BUILTIN_PROFILES:
        raise ValueError(f"--variant {spec!r}: {name!r} is a built-in policy; pick another name")
    if base not in BUILTIN_PROFILES:
        raise ValueError(
            f"--variant {spec!r}: unknown policy {base!r}; choose from: "
            + ", ".join(BUILTIN_PROFILES)
        )
    overrides: list[tuple[str, Value]] = []
    for item in assignments.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"--variant {spec!r}: bad assignment {item!r}; {form}")
        overrides.append((key.strip(), _value(value.strip())))
    variant = PolicyVariant(name, base, tuple(overrides))
    try:
        variant.build()  # unknown keys and bad values fail here, before any replay
    except ValueError as exc:  # pydantic's ValidationError included
        raise ValueError(f"--variant {spec!r}: {exc}") from None
    return variant
