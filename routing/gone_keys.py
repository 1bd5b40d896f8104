"""Refusing configuration keys that are gone, with what to do instead.

Models are strict, so a removed or renamed key is refused anyway; pydantic's own message ("extra
inputs are not permitted") does not say what replaced it. ``refuse_gone_keys`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

__all__ = ["refuse_gone_keys"]


def refuse_gone_keys(gone: Mapping[str, str]) -> Any:
    """A before-validator for a model's class body: ``ValueError(message)`` for the first key of
    ``gone`` (key -> message) that the input holds."""

    def check(cls: type, data: object) -> object:
        if isinstance(data, dict):
            for key, message in gone.items():
                if key in data:
                    raise ValueError(message)
        return data

    return model_validator(mode="before")(classmethod(check))
