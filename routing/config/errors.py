"""Policy errors that an SRE can act on: every one names a path, the value found and the reason.

Pydantic reports ``loc`` tuples and messages written for programmers ("Input should be greater
than 0"); this module turns them into ``routes[2].slo.ttft_p95_ms: must be > 0 (got -5)``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from routing.redis_env import SECRET_OPTION

#: Keys whose values are never echoed back: someone may have pasted a raw API key there.
_SECRET_KEYS = frozenset({"api_key_sha256"})
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]*@", re.IGNORECASE)
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")

Loc = Sequence[str | int]


def format_path(loc: Loc) -> str:
    """``("routes", 2, "slo", "ttft_p95_ms")`` → ``routes[2].slo.ttft_p95_ms``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.match(part):
            out += f".{part}" if out else part
        else:
            # Mapping keys such as pool names may hold dots or slashes; quote them.
            out += f"[{part!r}]"
    return out


def describe_value(value: Any, loc: Loc = ()) -> str:
    """A short, safe rendering of a value for an error message.

    Secrets are redacted (a raw key pasted where a hash belongs must not reach the logs) and so is
    the user-info part of URLs (``redis://:password@host``) and the passwords in a Redis URL's
    query (``password``, ``sentinel_password``, ``ssl_password``).
    """
    if any(isinstance(p, str) and p in _SECRET_KEYS for p in loc):
        return "<redacted>"
    if isinstance(value, str):
        text = _URL_USERINFO.sub(r"\g<scheme><redacted>@", value)
        text = SECRET_OPTION.sub(r"\1<redacted>", text)
        if len(text) > 80:
            text = text[:77] + "..."
        return repr(text)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


@dataclass(frozen=True)
class PolicyIssue:
    """One problem in a policy file."""

    path: str
    reason: str
    #: 1-based line in the source file, when known.
    line: int | None = None
    source: str | None = None
    #: The path as a tuple, so the loader can find the nearest line for it.
    loc: tuple[str | int, ...] = ()

    def __str__(self) -> str:
        where = ""
        if self.source is not None:
            where = f"{self.source}:{self.line}: " if self.line else f"{self.source}: "
        return f"{where}{self.path}: {self.reason}" if self.path else f"{where}{self.reason}"


class PolicyError(ValueError):
    """A policy was refused; ``errors`` lists every problem found, one line each."""

    def __init__(self, errors: Iterable[str | PolicyIssue]) -> None:
        self.issues: list[PolicyIssue] = [
            e if isinstance(e, PolicyIssue) else PolicyIssue(path="", reason=e) for e in errors
        ]
        self.errors: list[str] = [str(i) for i in self.issues]
        count = len(self.errors)
        head = self.errors[0] if self.errors else "invalid policy"
        more = f" (and {count - 1} more)" if count > 1 else ""
        super().__init__(f"{head}{more}")


def issue(loc: Loc, reason: str) -> PolicyIssue:
    """An issue at ``loc`` (no line yet; the loader adds it)."""
    return PolicyIssue(path=format_path(loc), reason=reason, loc=tuple(loc))


def issue_with_value(loc: Loc, reason: str, value: Any) -> PolicyIssue:
    """An issue at ``loc`` that quotes the offending value."""
    return issue(loc, f"{reason} (got {describe_value(value, loc)})")


def _reason(err: Any) -> tuple[str, bool]:
    """(reason, quote_value) for one pydantic error dict."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    simple = {
        "missing": ("required key is missing", False),
        "int_type": ("must be an integer", True),
        "int_from_float": ("must be an integer", True),
        "float_type": ("must be a number", True),
        "string_type": ("must be a string", True),
        "bool_type": ("must be true or false", True),
        "list_type": ("must be a list", True),
        "dict_type": ("must be a mapping", True),
        "model_type": ("must be a mapping", True),
        "model_attributes_type": ("must be a mapping", True),
        "finite_number": ("must be a finite number", True),
        "url_parsing": ("must be a URL", True),
    }
    if kind in simple:
        return simple[kind]
    bounds = {
        "greater_than": ("must be > {gt}", "gt"),
        "greater_than_equal": ("must be >= {ge}", "ge"),
        "less_than": ("must be < {lt}", "lt"),
        "less_than_equal": ("must be <= {le}", "le"),
    }
    if kind in bounds:
        template, key = bounds[kind]
        bound = ctx.get(key)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return template.format(**{key: bound}), True
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}", True
    if kind in ("string_too_short", "too_short"):
        if ctx.get("min_length") == 1:
            return "must not be empty", False
        unit = "characters" if kind == "string_too_short" else "items"
        return f"must have at least {ctx.get('min_length')} {unit}", False
    if kind in ("string_too_long", "too_long"):
        unit = "characters" if kind == "string_too_long" else "items"
        return f"must have at most {ctx.get('max_length')} {unit}", False
    if kind == "string_pattern_mismatch":
        return f"must match the pattern {ctx.get('pattern')}", True
    if kind == "value_error":
        # Our own validators raise ValueError("..."); pydantic prefixes "Value error, ".
        msg = str(err.get("msg", ""))
        return msg.removeprefix("Value error, "), False
    if kind == "assertion_error":
        return str(err.get("msg", "")).removeprefix("Assertion failed, "), False
    return str(err.get("msg", "invalid value")).replace("Input should be", "must be"), True


def unknown_key_hint(key: str, allowed: Any) -> str:
    """``; did you mean 'profile'? (allowed: ...)`` for an unknown ``key``: most are typos."""
    if not allowed:
        return ""
    allowed = [str(k) for k in allowed]
    # A key that is a word of an allowed one ('pools' of 'replica_pools', 'keys' of
    # 'api_key_sha256' singular or not) is a shortening, not a typo: spelling alone would
    # suggest 'profiles' for 'pools'.
    words = {k: set(k.split("_")) for k in allowed}
    whole = [k for k in allowed if key in words[k] or key.rstrip("s") in words[k]]
    close = whole[:1] or difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return f"{guess} (allowed: {', '.join(allowed)})"


def issues_from_validation(
    exc: ValidationError, prefix: Loc = (), allowed_keys: Any = None
) -> list[PolicyIssue]:
    """Convert a pydantic ``ValidationError`` into policy issues under ``prefix``.

    ``allowed_keys(loc)`` may return the keys valid at the parent of an unknown key, so the message
    can list them (most unknown keys are typos).
    """
    out: list[PolicyIssue] = []
    for err in exc.errors():
        loc = (*prefix, *(p for p in err["loc"] if isinstance(p, str | int)))
        if loc and loc[-1] == "[key]":
            # pydantic marks a bad mapping key by appending "[key]"; the path to it says enough.
            loc = loc[:-1]
        if err["type"] == "extra_forbidden":
            keys = allowed_keys(loc[:-1]) if allowed_keys else None
            hint = unknown_key_hint(str(loc[-1]) if loc else "", keys)
            out.append(issue(loc, f"unknown key{hint}"))
            continue
        reason, quote = _reason(err)
        if quote and "input" in err:
            out.append(issue_with_value(loc, reason, err["input"]))
        else:
            out.append(issue(loc, reason))
    return out
