"""Reading policy YAML: safe loading, refusing duplicate keys, and remembering line numbers.

PyYAML's ``safe_load`` silently keeps the last of two equal keys; in a routing policy that hides
a mistake (two ``slo`` blocks, one ignored), so this loader — a ``SafeLoader`` with the same safety
— refuses them. It also maps every path to its line so errors point into the file.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, SequenceNode

from routing.config.errors import Loc, PolicyIssue

#: Path tuple -> 1-based line number of that key or list item.
LineMap = dict[tuple[str | int, ...], int]


class _StrictSafeLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses duplicate and non-string mapping keys."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Check the mapping's own keys before merges (`<<: *defaults`) are flattened in, so an
        # explicit key may still override a merged one, as YAML intends.
        seen: dict[Any, int] = {}
        for key_node, _value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ConstructorError(
                    None,
                    None,
                    f"mapping key {key!r} must be a string (quote it)",
                    key_node.start_mark,
                )
            if key in seen:
                raise ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first on line {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


#: The most times nodes may be visited again through aliases (``*name``): a policy reuses a few
#: anchors a few times. A few hundred bytes of nested aliases (``b: &b [*a, *a, ...]``) expand
#: ninefold per level: one of 254 bytes took 4.4 s and 1.2 GB to read, on the gateway's event
#: loop at a reload. A large policy without aliases is never charged.
MAX_ALIAS_VISITS = 100_000


class _TooBig(Exception):
    """The document's aliases expand past ``MAX_ALIAS_VISITS``."""


def _collect_lines(
    node: Node, loc: tuple[str | int, ...], out: LineMap, seen: set[int], budget: list[int]
) -> None:
    if id(node) in seen:  # reached again through an alias
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooBig
    seen.add(id(node))
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            child = (*loc, str(key_node.value))
            out.setdefault(child, key_node.start_mark.line + 1)
            _collect_lines(value_node, child, out, seen, budget)
    elif isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            child = (*loc, i)
            out.setdefault(child, item.start_mark.line + 1)
            _collect_lines(item, child, out, seen, budget)


def read_yaml(text: str, source: str) -> tuple[Any, LineMap]:
    """Parse ``text``; returns (data, line map). Raises ``PolicySyntaxError`` on bad YAML, on
    characters YAML does not allow (a terminal's colour codes pasted in), on nesting too deep
    to read and on aliases that expand past ``MAX_ALIAS_VISITS``."""
    loader = None
    lines: LineMap = {}
    try:
        loader = _StrictSafeLoader(text)  # checks the characters: a ReaderError here
        node = loader.get_single_node()
        # Built first: building flattens merge keys (``<<: *defaults``) into the node tree, so
        # merged keys get their own lines. An alias is built once and shared, never expanded.
        data = loader.construct_document(node) if node is not None else None
        if node is not None:
            _collect_lines(node, (), lines, set(), [MAX_ALIAS_VISITS])
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        reason = " ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
        if "'\\t'" in reason:  # the commonest YAML mistake: say where, and the way out
            where = f" (column {mark.column + 1})" if mark is not None else ""
            reason += f"{where}; YAML cannot indent with tabs: use spaces"
        raise PolicySyntaxError(
            PolicyIssue(path="", reason=f"YAML syntax error: {reason}", line=line, source=source)
        ) from None
    except yaml.YAMLError as exc:
        raise PolicySyntaxError(
            PolicyIssue(path="", reason=f"YAML error: {exc}", source=source)
        ) from None
    except RecursionError:
        raise PolicySyntaxError(
            PolicyIssue(path="", reason="YAML nested too deeply to read", source=source)
        ) from None
    except _TooBig:
        raise PolicySyntaxError(
            PolicyIssue(
                path="",
                reason=f"its aliases (*name) expand to more than {MAX_ALIAS_VISITS:,} "
                "repeated YAML nodes: write the repeated parts out, or alias fewer of them",
                source=source,
            )
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines


def line_of(lines: LineMap, loc: Loc) -> int | None:
    """Line of ``loc``, or of its nearest ancestor present in the file (missing keys)."""
    path = tuple(loc)
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


class PolicySyntaxError(Exception):
    """Raised by ``read_yaml``; carries the one issue (the loader turns it into PolicyError)."""

    def __init__(self, problem: PolicyIssue) -> None:
        super().__init__(str(problem))
        self.issue = problem
