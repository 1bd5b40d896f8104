"""Reading and validating OpenAI request bodies (the gateway checks only what it must read)."""

from __future__ import annotations

import asyncio
import re
import uuid
import zlib
from collections.abc import Mapping
from typing import Any, Final

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway import errors
from gateway.errors import GatewayError, bad_request

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id`` if it is sane, else a new one."""
    given = request.headers.get("X-Request-Id", "")
    if _REQUEST_ID.match(given):
        return given
    return f"fg-{uuid.uuid4().hex}"


#: Where a request's ``X-Request-Id`` answer differs from the id the gateway used (web.Request
#: key): the client's own id, when only another caller had it in flight.
SHOWN_REQUEST_ID: Final = "fleetgate.shown_request_id"


def caller_scope(request: web.Request) -> str:
    """Who is calling, before authentication: a digest of the credential headers (the same
    key, the same scope; no key, one scope of its own)."""
    import hashlib

    credentials = "\x00".join(
        value
        for name in ("Authorization", "api-key", "x-api-key")
        for value in request.headers.getall(name, ())
    )
    return hashlib.sha256(credentials.encode()).hexdigest()[:16]


def unique_id(request_id: str, in_flight: set[str]) -> str:
    """``request_id``, or it with a random suffix when a request in flight already has it.

    Routing and flow control key their state by request id; two requests sharing one (a client
    that reuses its ids, or two tenants that pick the same) would overwrite each other's. The
    response's ``X-Request-Id`` shows the id the gateway used.
    """
    while request_id in in_flight:
        request_id = f"{request_id.split('~', 1)[0]}~{uuid.uuid4().hex[:8]}"
    return request_id


async def show_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the ``X-Request-Id`` a caller is shown. A client id that only
    another caller had in flight comes back as sent, though the gateway used it suffixed: the
    suffix would tell one tenant that another runs a request of that id (the security review);
    reused by the same caller, the suffix shows which request is which."""
    shown = request.get(SHOWN_REQUEST_ID)
    if shown is not None and "X-Request-Id" in response.headers:
        response.headers["X-Request-Id"] = shown


def engine_request_id(request_id: str) -> str:
    """The id an engine is sent for a request: the gateway's, with a random suffix.

    vLLM takes the ``X-Request-Id`` header as its own request id and refuses one already
    running. Client ids are unique only within one gateway (``unique_id``), and a tenant may
    pick any: sent as they are, two gateways could hand an engine the same id, so one tenant
    could learn that another's id is running, or fail its requests by reusing ids it can
    predict. The suffix keeps the engine's logs searchable by the client's id. One suffix
    always, on the client's id: vLLM names its answer after this id (``chatcmpl-<id>``), and
    the gateway's own suffix on an id another caller had in flight, passed on, showed a second
    one there (the diff review).
    """
    return f"{request_id.split('~', 1)[0]}~{uuid.uuid4().hex[:8]}"


async def read_json(
    request: web.Request, max_bytes: int, timeout_s: float | None = None
) -> dict[str, Any]:
    """The JSON object body; 413 past ``max_bytes`` (checked before and while reading), 408 if
    it takes longer than ``timeout_s`` to arrive, 400 else."""
    body, _raw = await read_body(request, max_bytes, timeout_s)
    return body


#: ``Content-Encoding`` values a request body may have besides ``identity``.
DECODED_ENCODINGS: Final = ("gzip", "deflate")

_READ_CHUNK: Final = 64 * 1024
#: Decoded bytes per decompression step; the event loop runs other callbacks between steps.
_DECODE_STEP: Final = 1024 * 1024


async def read_body(
    request: web.Request, max_bytes: int, timeout_s: float | None = None
) -> tuple[dict[str, Any], bytes]:
    """The JSON object body and the bytes it was parsed from (see ``read_json``).

    The whole body must arrive within ``timeout_s`` (None: no bound) or the answer is 408 and
    the connection closes: aiohttp's server bounds neither header nor body reads, so a client
    that trickles its body would otherwise hold the connection and its handler indefinitely.

    A compressed body (``Content-Encoding: gzip`` or ``deflate``) is limited by its *decoded*
    size: it is decoded here, in bounded steps, and refused with 413 as soon as the decoded
    bytes pass ``max_bytes``, so a small body that inflates to gigabytes costs at most
    ``max_bytes`` of decompression. Other encodings are 415; a body that does not decode is 400.
    The app turns aiohttp's own decoding off (``gateway.app.HANDLER_ARGS``): it would inflate
    the whole rest of a refused body on the event loop while discarding it.
    """
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    compressed = encoding not in ("", "identity")
    if compressed and encoding not in DECODED_ENCODINGS:
        raise GatewayError(
            415,
            errors.UNSUPPORTED_ENCODING,
            f"Content-Encoding {encoding!r} is not supported; send the body uncompressed or "
            f"with one of: {', '.join(DECODED_ENCODINGS)}.",
            headers={"Accept-Encoding": ", ".join(DECODED_ENCODINGS)},
        )
    length = request.content_length
    if length is not None and length > max_bytes:
        raise _too_large(max_bytes)
    try:
        async with asyncio.timeout(timeout_s):
            if compressed:
                raw = await _read_decoded(request, encoding, max_bytes)
            elif length is not None and "Transfer-Encoding" not in request.headers:
                # Known length within the limit: the HTTP parser stops at it: read it in one go.
                raw = await request.content.read()
            else:
                raw = await _read_limited(request, max_bytes)
    except web.RequestPayloadError as exc:  # a body cut short or malformed on the wire
        raise bad_request(f"Request body could not be read: {_reason(exc)}") from None
    except TimeoutError:
        raise _too_slow(timeout_s) from None
    return parse_json_object(raw), raw


async def _read_limited(request: web.Request, max_bytes: int) -> bytes:
    """The body, read in steps (a chunked body without Content-Length cannot exhaust memory);
    413 once it passes ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(_READ_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_decoded(request: web.Request, encoding: str, max_bytes: int) -> bytes:
    """The decoded body of a ``gzip`` / ``deflate`` request; 413 once the *decoded* bytes pass
    ``max_bytes``, 400 if it does not decode. Each step inflates at most ``_DECODE_STEP`` bytes.
    """
    decoder: Any = None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(_READ_CHUNK):
        if decoder is None:
            decoder = _decoder(encoding, chunk)
        data = chunk
        while data:
            if decoder.eof:
                raise _not_encoded(encoding, "data after the end of the compressed stream")
            try:
                out = decoder.decompress(data, _DECODE_STEP)
            except zlib.error:
                raise _not_encoded(encoding, "not a valid compressed stream") from None
            size += len(out)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(out)
            data = decoder.unconsumed_tail
            if data:
                await asyncio.sleep(0)  # a highly compressible body: let others run
    # Input all read, output maybe not: a step that ended on the step limit inside the last
    # match leaves bytes in the decoder (raw deflate has no trailer to push them out).
    while decoder is not None and not decoder.eof:
        try:
            out = decoder.decompress(b"", _DECODE_STEP)
        except zlib.error:
            raise _not_encoded(encoding, "not a valid compressed stream") from None
        if not out:
            break
        size += len(out)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(out)
        await asyncio.sleep(0)
    if decoder is None or not decoder.eof:
        raise _not_encoded(encoding, "the compressed stream is truncated")
    return b"".join(chunks)


def _decoder(encoding: str, first: bytes) -> Any:
    if encoding == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    # RFC 9110's deflate is zlib-wrapped; some clients send raw deflate (as aiohttp accepts).
    wrapped = bool(first) and first[0] & 0x0F == 8
    return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)


def _not_encoded(encoding: str, why: str) -> GatewayError:
    return bad_request(f"Request body is not valid {encoding} data ({why}).")


def _reason(exc: BaseException) -> str:
    """What went wrong reading the body, in the parser's words (never bytes of the body)."""
    cause = exc.__cause__
    if isinstance(cause, HttpProcessingError) and cause.message:
        return str(cause.message)
    return str(exc) or type(exc).__name__


def _too_slow(timeout_s: float | None) -> GatewayError:
    message = (
        f"The request body did not arrive within {timeout_s:g} s of its headers; send it "
        "whole without pauses (an operator can raise gateway.body_timeout_s for slow links)."
    )
    # aiohttp closes the connection after the answer (its body unread), within 10 s.
    return GatewayError(408, errors.BODY_TIMEOUT, message)


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
    """``prompt``: a string, an array of strings, or token ids (one list or a batch of lists);
    or none, as vLLM allows, with ``prompt_embeds`` (engines run with
    ``--enable-prompt-embeds``), which the engine checks."""
    if prompt_embeds_only(body):
        return
    if not _valid_prompt(body.get("prompt")):
        raise bad_request("`prompt` must be a string, an array of strings, or token ids.", "prompt")


def prompt_embeds_only(body: Mapping[str, Any]) -> bool:
    """Whether a completion request gives its prompt as ``prompt_embeds`` (base64 tensors) alone,
    as vLLM reads it: no ``prompt`` (or an empty one), ``prompt_embeds`` not an empty list."""
    embeds = body.get("prompt_embeds")
    return body.get("prompt") in (None, "") and embeds is not None and embeds != []


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
