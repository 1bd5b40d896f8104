"""Small constructors for ``Advice`` rows, so every rule words "no change" the same way."""

from __future__ import annotations

from typing import Any

from planning.advise.model import Advice, EngineFlags


def flag_name(field: str) -> str:
    """``max_model_len`` -> ``--max-model-len``."""
    return "--" + field.replace("_", "-")


def change(flags: EngineFlags, field: str, advised: Any, evidence: str, effect: str = "") -> Advice:
    """Set ``field`` to ``advised``."""
    current = getattr(flags, field)
    source = flags.source(field)
    return Advice(flag_name(field), "change", current, source, advised, evidence, effect)


def keep(flags: EngineFlags, field: str, evidence: str) -> Advice:
    """Today's value is right."""
    current = getattr(flags, field)
    return Advice(flag_name(field), "no change", current, flags.source(field), current, evidence)


def unchecked(flags: EngineFlags, field: str, missing: str) -> Advice:
    """The rule could not run; ``missing`` says what it needs."""
    current = getattr(flags, field)
    return Advice(
        flag_name(field), "not checked", current, flags.source(field), None, f"needs {missing}"
    )


def tokens(value: float) -> str:
    """A token count for prose: ``1,536``."""
    return f"{value:,.0f}"
