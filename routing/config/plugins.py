"""Plugins and profiles, in llm-d's shape.

``plugins`` declares configured instances of registered plugin types (``{type, name,
parameters}``); ``profiles`` compose them by name into a filter → score → pick pipeline.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from routing.config.base import Name, NonNegativeFloat, StrictModel


class PluginSpec(StrictModel):
    """A configured plugin instance; ``parameters`` are checked by the type's own ``Params``."""

    #: A type name registered in ``routing/policies/registry.py``.
    type: str = Field(min_length=1)
    #: Instance name that profiles refer to; defaults to the type name.
    name: Name | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def ref_name(self) -> str:
        """The name profiles use to refer to this instance."""
        return self.name if self.name is not None else self.type


class ScorerRef(StrictModel):
    """A scorer in a profile with its weight (the engine multiplies the [0, 1] score by it)."""

    ref: str = Field(min_length=1)
    weight: NonNegativeFloat = 1.0


class ProfileSpec(StrictModel):
    """A named pipeline: every filter in order, the weighted sum of scorers, then the picker."""

    name: Name
    filters: list[str] = Field(default_factory=list)
    scorers: list[ScorerRef] = Field(default_factory=list)
    picker: str = Field(min_length=1)

    @model_validator(mode="after")
    def _no_repeats(self) -> ProfileSpec:
        refs = [s.ref for s in self.scorers]
        if len(set(refs)) != len(refs):
            raise ValueError("a scorer is listed twice; give it one weight")
        if len(set(self.filters)) != len(self.filters):
            raise ValueError("a filter is listed twice")
        return self
