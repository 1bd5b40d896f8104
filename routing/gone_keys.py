"""Refusing configuration keys that are gone, with what to do instead.

Models are strict, so a removed or renamed key is refused anyway; pydantic's own message ("extra
inputs are not permitted") does not say what replaced it. ``refuse_gone_keys`` does, and
``gone_keys`` hands the same messages to a caller that reports unknown keys itself before the
model sees them (the policy checks), so that the hint still reaches whoever runs an old policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, model_validator

__all__ = ["gone_keys", "refuse_gone_keys"]

#: Where ``refuse_gone_keys`` leaves its mapping on the validator, for ``gone_keys`` to find.
_GONE = "_fleetgate_gone_keys"


def refuse_gone_keys(gone: Mapping[str, str]) -> Any:
    """A before-validator for a model's class body: ``ValueError(message)`` for the first key of
    ``gone`` (key -> message) that the input holds."""

    def check(cls: type, data: object) -> object:
        if isinstance(data, dict):
            for key, message in gone.items():
                if key in data:
                    raise ValueError(message)
        return data

    setattr(check, _GONE, dict(gone))
    return model_validator(mode="before")(classmethod(check))


def gone_keys(model: type[BaseModel]) -> dict[str, str]:
    """Every key ``model`` (its bases included) refuses through ``refuse_gone_keys``, with its
    message."""
    found: dict[str, str] = {}
    for validator in model.__pydantic_decorators__.model_validators.values():
        found.update(getattr(validator.func, _GONE, {}))
    return found
