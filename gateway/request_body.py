"""Reading and validating OpenAI request bodies (the gateway checks only what it must read)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any, Final

import msgspec
from aiohttp import web

from gateway import errors
from gateway.errors import GatewayError, bad_request

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id`` if it is sane, else a new one."""
    given = request.headers.get("X-Request-Id", "")
    if _REQUEST_ID.match(given):
        return given
    return f"fg-{uuid.uuid4().hex}"


def unique_id(request_id: str, in_flight: set[str]) -> str:
    """``request_id``, or it with a random suffix when a request in flight already has it.

    Routing and flow control key their state by request id; two requests sharing one (a client
    that reuses its ids, or two tenants that pick the same) would overwrite each other's. The
    response's ``X-Request-Id`` shows the id the gateway used.
    """
    while request_id in in_flight:
        request_id = f"{request_id.split('~', 1)[0]}~{uuid.uuid4().hex[:8]}"
    return request_id


async def read_json(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The JSON object body; 413 past ``max_bytes`` (checked before and while reading), 400 else."""
    body, _raw = await read_body(request, max_bytes)
    return body


async def read_body(request: web.Request, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """The JSON object body and the bytes it was parsed from (see ``read_json``)."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise _too_large(max_bytes)
    if length is not None and "Transfer-Encoding" not in request.headers:
        # Known length within the limit: the HTTP parser stops at it, so read it in one go.
        raw = await request.content.read()
        return parse_json_object(raw), raw
    chunks: list[bytes] = []
    size = 0
    # Read incrementally so a chunked body without Content-Length cannot exhaust memory.
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return parse_json_object(raw), raw


def _too_large(max_bytes: int) -> GatewayError:
    message = f"Request body exceeds the limit of {max_bytes} bytes."
    return GatewayError(413, errors.BODY_TOO_LARGE, message)


#: msgspec: ~3x faster than ``json.loads`` on prompts. Stricter on non-JSON only (``NaN``,
#: ``Infinity``, lone surrogate escapes are refused with a 400, as RFC 8259 says they should be).
_decode_json = msgspec.json.Decoder().decode


#: Deepest nesting of arrays and objects a body may have, the body object itself being level 1.
#: An image part needs 6 (body, messages, message, content, part, image_url); JSON schemas in
#: ``tools`` and ``response_format`` rarely pass 20. The limit keeps a body nested thousands deep
#: from code that recurses over it (msgspec itself, our encoders, vLLM behind us).
MAX_JSON_DEPTH: Final = 128

_TOO_DEEP: Final = f"Request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels."

#: The container types msgspec decodes JSON arrays and objects to (exactly these, no subclasses).
_CONTAINER_TYPES: Final = frozenset((dict, list))


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; 400 if it is not one or nests deeper than ``MAX_JSON_DEPTH``."""
    try:
        body = _decode_json(raw)
    except RecursionError:
        # msgspec's own guard (about 1,000 levels, less the caller's stack): still too deep.
        raise bad_request(_TOO_DEEP, code=errors.INVALID_JSON) from None
    except (ValueError, UnicodeDecodeError) as exc:
        message = f"Request body is not valid JSON: {exc}"
        raise bad_request(message, code=errors.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.", code=errors.INVALID_JSON)
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise bad_request(_TOO_DEEP, code=errors.INVALID_JSON)
    return body


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether decoded JSON ``value`` has containers more than ``limit`` levels deep.

    Breadth-first and iterative, so a deep value cannot exhaust the stack here either. Costs one
    type check per array element and object value (strings are not scanned): measured ~1.5 us for
    a two-message chat body of 8 KB, ~15 us for 30 KB with five tool schemas (decoding it: ~40 us).
    """
    level = [value] if _is_container(value) else []
    for _ in range(limit):
        level = _containers_below(level)
        if not level:
            return False
    return bool(level)


def _is_container(value: Any) -> bool:
    return value.__class__ is dict or value.__class__ is list


def _containers_below(level: list[Any]) -> list[Any]:
    """The arrays and objects directly inside the containers of ``level``."""
    below: list[Any] = []
    for node in level:
        children = node.values() if node.__class__ is dict else node
        # Long runs of scalars (token ids, embeddings) are skipped at C speed.
        if len(children) > 8 and _CONTAINER_TYPES.isdisjoint(map(type, children)):
            continue
        for child in children:
            if child.__class__ is dict or child.__class__ is list:
                below.append(child)
    return below


def validate(body: Mapping[str, Any], kind: str) -> None:
    """Check the fields the gateway reads; every other field passes through to vLLM untouched."""
    validate_common(body)
    if kind == "chat":
        validate_chat(body)
    else:
        validate_completion(body)


def validate_common(body: Mapping[str, Any]) -> None:
    """``model``, ``stream`` and ``stream_options``: what every kind of request is read for."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", "model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("`stream` must be a boolean.", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("`stream_options` must be an object.", "stream_options")


def validate_chat(body: Mapping[str, Any]) -> None:
    """``messages``: a non-empty array of objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty array.", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("Each message must be an object.", "messages")


def validate_completion(body: Mapping[str, Any]) -> None:
    """``prompt``: a string, an array of strings, or token ids (one list or a batch of lists)."""
    if not _valid_prompt(body.get("prompt")):
        raise bad_request("`prompt` must be a string, an array of strings, or token ids.", "prompt")


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return True
    return all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        for p in prompt
    )
