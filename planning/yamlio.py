"""YAML for the planning inputs (``plan levers --params``, ``triage --input``, advise snapshots).

PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent: it reads
``70.6e9``, ``7e9`` and ``1e3`` as *strings*, and only ``8.03e+9`` as a number. People write the
former (YAML 1.2 and JSON read them as numbers), so ``load`` reads every decimal number with an
exponent as a number: an ``int`` when its value is whole (``8e3`` is a valid ``--max-model-len``),
else a ``float``. Two exceptions stay strings: a mapping key (a pool or route named ``1e3`` stays
``"1e3"``; no key is a number), and a value too large for a float (``4e10931``, a hex-looking id,
is not ``inf``). Everything else is ``yaml.safe_load``'s. ``dump`` is ``yaml.safe_dump`` that
quotes strings ``load`` would read as numbers (``"7e9"``), so what it writes reads back the same.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

_TAG = "tag:fleetgate.dev,2025:exponent-number"
#: A decimal number with an exponent, dot optional (YAML 1.2 core schema, plus ``_`` separators).
_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
#: Whole values up to this magnitude become ints (beyond it a float is not exact anyway).
_EXACT = 2**53


_STR = "tag:yaml.org,2002:str"


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` with exponent numbers resolved before YAML 1.1's float pattern."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Keys are names (pools, routes, flags), never numbers: an exponent key stays a string.
        for key_node, _value_node in node.value:
            if key_node.tag == _TAG:
                key_node.tag = _STR
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """``SafeDumper`` that quotes the strings ``_Loader`` would read as exponent numbers."""


for _cls in (_Loader, _Dumper):
    _cls.yaml_implicit_resolvers = {
        first: list(resolvers)
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    for _first in "-+0123456789.":
        _cls.yaml_implicit_resolvers.setdefault(_first, []).insert(0, (_TAG, _EXPONENT))


def _exponent_number(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int | float | str:
    text = str(loader.construct_scalar(node))
    value = float(text.replace("_", ""))
    if not math.isfinite(value):
        return text  # beyond a float (4e10931): a name or id, not a number
    return int(value) if value.is_integer() and abs(value) <= _EXACT else value


_Loader.add_constructor(_TAG, _exponent_number)


def load(text: str) -> Any:
    """``yaml.safe_load`` that also reads ``70.6e9`` and ``1e3`` as numbers; raises
    ``yaml.YAMLError`` like it."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: safe


def dump(data: Any, **kwargs: Any) -> str:
    """``yaml.safe_dump`` whose output ``load`` reads back as ``data`` (``"7e9"`` quoted)."""
    return yaml.dump(data, Dumper=_Dumper, **kwargs)  # a SafeDumper subclass: safe
