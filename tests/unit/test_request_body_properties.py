"""Property tests: any request body is a parsed request or a defined 400, never an exception.

The functions under test are the gateway's body checks (``parse_json_object`` then ``validate``),
called directly; tests/integration/test_gateway_body_fuzz.py sends bodies through a real gateway.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway import errors
from gateway.errors import GatewayError
from gateway.request_body import MAX_JSON_DEPTH, nests_deeper_than, parse_json_object, validate

#: Deterministic and bounded for CI: the same examples every run, no timing assertions, and no
#: example database written into the working tree.
PROPERTY = settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

#: The codes the body checks may answer with (docs/api.md, "Errors").
BODY_ERROR_CODES = {errors.INVALID_JSON, errors.INVALID_REQUEST}

KINDS = ("chat", "completion")


# --------------------------------------------------------------------------- strategies

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)

JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)

CONTENT = st.text(max_size=40) | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
    | st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": st.text()})}
    ),
    min_size=1,
    max_size=3,
)

MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": CONTENT}
    ),
    min_size=1,
    max_size=4,
)

PROMPTS = (
    st.text(max_size=40)
    | st.lists(st.text(max_size=10), min_size=1, max_size=3)
    | st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8)
    | st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=4), min_size=1, max_size=3)
)

OPTIONAL_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "max_tokens": st.integers(1, 64),
        "temperature": st.floats(0, 2),
        "cache_salt": st.text(max_size=8),
    },
)

MODELS = st.text(min_size=1, max_size=12)


@st.composite
def valid_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A (kind, body) pair the gateway must accept."""
    kind = draw(st.sampled_from(KINDS))
    body: dict[str, Any] = {"model": draw(MODELS), **draw(OPTIONAL_FIELDS)}
    if kind == "chat":
        body["messages"] = draw(MESSAGES)
    else:
        body["prompt"] = draw(PROMPTS)
    return kind, body


def _set_at_random_path(draw: st.DrawFn, value: Any, replacement: Any) -> Any:
    """``value`` with one nested member (or itself) replaced by ``replacement``."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: _set_at_random_path(draw, value[key], replacement)}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], _set_at_random_path(draw, value[i], replacement), *value[i + 1 :]]
    return replacement


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid body with one field dropped, replaced by any JSON value, or one member changed."""
    kind, body = draw(valid_bodies())
    how = draw(st.sampled_from(["drop", "replace-field", "replace-member"]))
    key = draw(st.sampled_from(sorted(body)))
    if how == "drop":
        del body[key]
    elif how == "replace-field":
        body[key] = draw(JSON_VALUES)
    else:
        body = _set_at_random_path(draw, body, draw(JSON_VALUES))
    return kind, body


@st.composite
def mutated_bytes(draw: st.DrawFn) -> tuple[str, bytes]:
    """The encoding of a valid body with bytes flipped, inserted, removed or cut off."""
    kind, body = draw(valid_bodies())
    raw = bytearray(json.dumps(body).encode())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(raw)))
        how = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if how == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=3))
        elif how == "truncate":
            del raw[at:]
        elif at < len(raw):
            if how == "flip":
                raw[at] = draw(st.integers(0, 255))
            else:
                del raw[at]
    return kind, bytes(raw)


def nested(depth: int, leaf: bytes = b"1") -> bytes:
    """A chat body whose ``messages[0].content`` makes the whole body ``depth`` levels deep."""
    inner = depth - 3  # body, messages, message
    return (
        b'{"model":"m","messages":[{"role":"user","content":'
        + b"[" * inner + leaf + b"]" * inner + b"}]}"
    )


# --------------------------------------------------------------------------- the property


def check(raw: bytes, kind: str) -> dict[str, Any] | GatewayError:
    """The parsed body, or the defined 400 it got; anything else escaping fails the test."""
    try:
        body = parse_json_object(raw)
        validate(body, kind)
    except GatewayError as err:
        assert err.status == 400, err.message
        assert err.code in BODY_ERROR_CODES
        json.dumps(err.envelope())  # the envelope always serialises
        return err
    assert isinstance(body, dict)
    return body


@PROPERTY
@given(raw=st.binary(max_size=200), kind=st.sampled_from(KINDS))
@example(raw=b"\xef\xbb\xbf{}", kind="chat")  # a UTF-8 byte order mark
@example(raw=b'{"model":"m","messages":[{"content":"\xff"}]}', kind="chat")  # invalid UTF-8
@example(raw=b'{"model":"m","prompt":"\\ud800"}', kind="completion")  # a lone surrogate
def test_any_bytes(raw: bytes, kind: str) -> None:
    check(raw, kind)


@PROPERTY
@given(value=JSON_VALUES, kind=st.sampled_from(KINDS))
def test_any_json_value(value: Any, kind: str) -> None:
    result = check(json.dumps(value).encode(), kind)
    if isinstance(result, dict):
        assert result == value


@PROPERTY
@given(case=valid_bodies())
def test_valid_bodies_are_accepted_unchanged(case: tuple[str, dict[str, Any]]) -> None:
    kind, body = case
    assert check(json.dumps(body).encode(), kind) == body


@PROPERTY
@given(case=mutated_bodies())
def test_mutated_bodies(case: tuple[str, dict[str, Any]]) -> None:
    kind, body = case
    check(json.dumps(body).encode(), kind)


@PROPERTY
@given(case=mutated_bytes())
def test_mutated_bytes(case: tuple[str, bytes]) -> None:
    kind, raw = case
    check(raw, kind)


@PROPERTY
@given(case=valid_bodies(), depth=st.integers(1, 300))
@example(case=("chat", {"model": "m", "messages": [{"role": "user"}]}), depth=5000)
def test_too_deep_bodies_are_invalid_json(case: tuple[str, dict[str, Any]], depth: int) -> None:
    """Nesting at any depth gives a parsed body or 400 ``invalid_json`` naming the limit."""
    kind, body = case
    body["deep"] = "@"
    raw = json.dumps(body).encode().replace(b'"@"', b"[" * depth + b"]" * depth)
    result = check(raw, kind)
    if depth + 1 <= MAX_JSON_DEPTH:  # the body object is level 1
        assert isinstance(result, dict)
    else:
        assert isinstance(result, GatewayError) and result.code == errors.INVALID_JSON
        assert str(MAX_JSON_DEPTH) in result.message


# --------------------------------------------------------------------------- the depth limit


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 5_000, 100_000])
def test_deep_nesting_is_400_invalid_json(depth: int) -> None:
    """The issue's report: 5,000 levels was a 500 (msgspec's RecursionError escaped)."""
    with pytest.raises(GatewayError) as caught:
        parse_json_object(nested(depth))
    assert (caught.value.status, caught.value.code) == (400, errors.INVALID_JSON)
    assert f"deeper than {MAX_JSON_DEPTH} levels" in caught.value.message
    assert caught.value.envelope()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("leaf", [b"1", b"{}", b'"x"'])
def test_nesting_up_to_the_limit_is_accepted(leaf: bytes) -> None:
    depth = MAX_JSON_DEPTH - 1 if leaf == b"{}" else MAX_JSON_DEPTH  # ``{}`` is a level itself
    assert parse_json_object(nested(depth, leaf))["model"] == "m"


def test_real_bodies_are_far_from_the_limit() -> None:
    """Image parts and a JSON-schema tool, as the OpenAI SDK sends them."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(10):  # a schema ten objects deep, deeper than real ones
        schema = {"type": "object", "properties": {"child": {"type": "array", "items": schema}}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }
    assert parse_json_object(json.dumps(body).encode()) == body
    assert not nests_deeper_than(body, 45)


def _depth(value: Any) -> int:
    """Reference nesting depth (recursive: only for the small values hypothesis draws)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@PROPERTY
@given(value=JSON_VALUES, limit=st.integers(0, 6))
@example(value=[[1] * 20, [[1]]], limit=2)  # a long scalar run beside a deeper sibling
def test_nests_deeper_than_matches_the_definition(value: Any, limit: int) -> None:
    assert nests_deeper_than(value, limit) == (_depth(value) > limit)
