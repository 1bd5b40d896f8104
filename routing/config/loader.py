"""``load_policy`` / ``parse_policy``: YAML text → validated ``Policy``, or every error at once.

Three stages, each collecting all its errors: strict structural decoding of the whole document;
each plugin's parameters through its own ``Params`` model; then cross-references. The later stages
also run when the structure has errors, on the entries that were valid, so an SRE sees the whole
list in one go instead of fixing a file one error at a time.
"""

from __future__ import annotations

import contextlib
import os
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from routing.config.catalog import PluginCatalog
from routing.config.checks import check_policy
from routing.config.errors import (
    Loc,
    PolicyError,
    PolicyIssue,
    describe_value,
    issue,
    issues_from_validation,
)
from routing.config.policy import Policy
from routing.config.yaml_source import LineMap, PolicySyntaxError, line_of, read_yaml

#: Larger files are refused before parsing; a real policy is a few hundred lines.
MAX_POLICY_BYTES = 4 * 1024 * 1024


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to the type that holds keys or items."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def allowed_keys(loc: Loc) -> list[str] | None:
    """The keys valid at ``loc`` in the policy schema (for "unknown key" hints)."""
    tp: Any = Policy
    for part in loc:
        tp = _unwrap(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str):
            field = tp.model_fields.get(part)
            if field is None:
                return None
            tp = field.annotation
        elif origin is list and isinstance(part, int):
            tp = typing.get_args(tp)[0]
        elif origin is dict and isinstance(part, str):
            tp = typing.get_args(tp)[1]
        else:
            return None
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return None


def _entry_name(section: str, item: Any) -> str | None:
    """The name a (possibly invalid) raw entry would define, for reference checking."""
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    if section == "plugins" and name is None:
        name = item.get("type")  # a plugin's name defaults to its type
    return name if isinstance(name, str) else None


def _partial_policy(data: dict[str, Any]) -> tuple[Policy, dict[str, set[str]]]:
    """A policy of only the structurally valid entries, plus the names of the invalid ones.

    Used only to keep checking references after structural errors; never returned to callers.
    """
    fields: dict[str, Any] = {"version": 1}
    invalid: dict[str, set[str]] = {}
    for key, info in Policy.model_fields.items():
        tp = _unwrap(info.annotation)
        is_list = typing.get_origin(tp) is list
        if key == "version" or key not in data:
            if is_list:
                fields[key] = []  # required lists have no default to fall back on
            continue
        value = data[key]
        if is_list:
            adapter = TypeAdapter(typing.get_args(tp)[0])
            kept = []
            for item in value if isinstance(value, list) else []:
                try:
                    kept.append(adapter.validate_python(item))
                except ValidationError:
                    if (name := _entry_name(key, item)) is not None:
                        invalid.setdefault(key, set()).add(name)
            fields[key] = kept
        else:
            # On failure the default stands in; the structural errors already say why.
            with contextlib.suppress(ValidationError):
                fields[key] = TypeAdapter(info.annotation).validate_python(value)
    return Policy.model_construct(**fields), invalid


def _with_lines(issues: list[PolicyIssue], lines: LineMap, source: str) -> list[PolicyIssue]:
    located = [
        PolicyIssue(
            path=i.path, reason=i.reason, line=line_of(lines, i.loc), source=source, loc=i.loc
        )
        for i in issues
    ]
    # File order reads best; sorted() is stable, so issues on one line keep their order.
    return sorted(located, key=lambda i: i.line if i.line is not None else 0)


def parse_policy(
    text: str, source: str = "<string>", *, catalog: PluginCatalog | None = None
) -> Policy:
    """Validate policy YAML ``text``. Raises ``PolicyError`` listing every problem.

    ``source`` names the text in error messages (a file path). ``catalog`` defaults to the plugin
    registry; tests pass a small fake one.
    """
    try:
        data, lines = read_yaml(text, source)
    except PolicySyntaxError as exc:
        raise PolicyError([exc.issue]) from None
    if data is None:
        raise PolicyError([PolicyIssue(path="", reason="policy is empty", source=source)])
    if not isinstance(data, dict):
        raise PolicyError(
            [
                PolicyIssue(
                    path="",
                    reason="the top level must be a mapping of sections (got "
                    f"{describe_value(data)})",
                    line=1,
                    source=source,
                )
            ]
        )

    catalog = catalog if catalog is not None else PluginCatalog.from_registry()
    problems: list[PolicyIssue] = []
    try:
        policy = Policy.model_validate(data)
        invalid: dict[str, set[str]] = {}
    except ValidationError as exc:
        problems.extend(issues_from_validation(exc, allowed_keys=allowed_keys))
        if data.get("version") != 1 and "version" in data:
            # Another schema version: checking it against this one would only add noise.
            raise PolicyError(_with_lines(problems, lines, source)) from None
        policy, invalid = _partial_policy(data)

    cross, params = check_policy(policy, catalog, invalid)
    problems.extend(cross)
    if problems:
        raise PolicyError(_with_lines(problems, lines, source))
    policy._plugin_params = params
    policy._source = source
    return policy


def load_policy(path: str | os.PathLike[str], *, catalog: PluginCatalog | None = None) -> Policy:
    """Read and validate the policy file at ``path``. Raises ``PolicyError`` on any problem."""
    name = os.fspath(path)
    file = Path(name)
    try:
        size = file.stat().st_size
        if size > MAX_POLICY_BYTES:
            raise PolicyError(
                [issue((), f"{name}: file is {size} bytes; the limit is {MAX_POLICY_BYTES}")]
            )
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([f"{name}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise PolicyError([f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    return parse_policy(text, source=name, catalog=catalog)
