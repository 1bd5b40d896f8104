"""The simulated replica's other vLLM APIs: Responses, Anthropic Messages, embeddings, detokenize.

Mounted by ``replica.sim.app.build_app`` beside chat and completions, served in vLLM 0.32's
shapes (``replica.sim.api_shapes``):

* ``POST /v1/responses`` (streaming and not), ``GET /v1/responses/{id}``,
  ``POST /v1/responses/{id}/cancel``. Responses are stored in the replica that made them (as
  vLLM does with ``VLLM_ENABLE_RESPONSES_API_STORE=1``; ``SimServerConfig.responses_store``), so
  ``previous_response_id`` works only here: any other replica answers vLLM's 404.
* ``POST /v1/messages`` (streaming and not) and ``POST /v1/messages/count_tokens``, errors in
  vLLM's Anthropic envelope.
* ``POST /v1/embeddings``: deterministic unit vectors of the token ids (float or base64). A real
  vLLM serves embeddings only from a pooling model; the sim answers at once, without engine time.
* ``POST /detokenize``.

Generation goes through the same engine model as chat: a Responses or Messages request is its
chat messages (``routing.api_messages``) rendered through the chat template.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from replica.sim.api_shapes import (
    MessageShapes,
    ResponseShapes,
    anthropic_error,
    anthropic_usage,
    embedding_data,
    embedding_response,
    embedding_vector,
    responses_usage,
    sse_event,
)
from replica.sim.driver import RequestAborted, RequestStream
from replica.sim.server import (
    REPLICA_KEY,
    ApiError,
    SimReplica,
    _cache_salt,
    _chat_prompt,
    _json_body,
    _max_tokens,
    _priority,
    _submit,
)
from routing.api_messages import anthropic_messages, responses_messages


@dataclass(frozen=True)
class StoredResponse:
    """What a follow-up needs: the input messages, the answer's text, and the full body."""

    messages: list[dict[str, Any]]
    output_text: str
    body: dict[str, Any]


class ResponseStore:
    """This replica's stored responses, oldest evicted first past ``capacity``.

    vLLM never evicts (its store is a plain dict, "may cause a memory leak"); a bound keeps a
    long-running sim from growing without end.
    """

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._items


STORE_KEY = web.AppKey("sim_response_store", ResponseStore)

#: Embedding width when the request gives no ``dimensions`` (small: the vectors are synthetic).
DEFAULT_EMBEDDING_DIMENSIONS = 64


def _not_found(response_id: str) -> ApiError:
    """vLLM's ``_make_not_found_error``."""
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                    "response_id")


async def _collect(stream: RequestStream, decode: Callable[[list[int]], str]) -> str:
    pieces = []
    while tokens := await stream.next_tokens():
        pieces.append(decode(tokens))
    return "".join(pieces)


@contextlib.asynccontextmanager
async def _aborting_on_exit(replica: SimReplica, stream: RequestStream) -> AsyncIterator[None]:
    """A client that left mid-answer must not keep its KV blocks in the engine."""
    try:
        yield
    finally:
        if not stream.finished:
            replica.driver.abort(stream.request_id)


async def _open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


def _cached(replica: SimReplica, stream: RequestStream) -> int | None:
    return stream.cached_tokens if replica.config.enable_prompt_tokens_details else None


# --------------------------------------------------------------------------- Responses API


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    replica = request.app[REPLICA_KEY]
    store = request.app[STORE_KEY]
    body = await _json_body(request)
    adapter = replica.resolve_model(body.get("model"))
    if body.get("background"):
        raise ApiError(400, "The simulated replica does not run background responses.",
                       param="background")
    previous_id = body.get("previous_response_id")
    previous = None
    if previous_id is not None and (
        not isinstance(previous_id, str) or (previous := store.get(previous_id)) is None
    ):
        raise _not_found(str(previous_id))
    try:
        messages = responses_messages(
            body,
            previous.messages if previous else None,
            [previous.output_text] if previous and previous.output_text else (),
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), param="input") from exc
    prompt = _chat_prompt(replica, messages, True)
    max_tokens = _max_tokens(replica, body.get("max_output_tokens"), len(prompt),
                             "max_output_tokens")
    stream = _submit(replica, prompt, max_tokens, adapter, _cache_salt(body),
                     request.headers.get("X-Request-Id"), _priority(body))
    shapes = ResponseShapes(body, body.get("model") or replica.config.model, max_tokens)
    # vLLM silently ignores store=true unless its store is enabled.
    keep = replica.config.responses_store and body.get("store", True) is not False
    decode = replica.tokenizer.decode

    def finish(text: str) -> tuple[str, dict[str, Any]]:
        # The sim generates until max tokens, which vLLM reports as "incomplete".
        status = "incomplete" if stream.generated >= max_tokens else "completed"
        use = responses_usage(stream.prompt_tokens, stream.generated, stream.cached_tokens)
        if keep:
            full = shapes.response(status, text, use)
            store.put(shapes.id, StoredResponse(messages, text, full))
        return status, use

    async with _aborting_on_exit(replica, stream):
        try:
            if not body.get("stream"):
                text = await _collect(stream, decode)
                status, use = finish(text)
                return web.json_response(shapes.response(status, text, use))
            response = await _open_sse(request)
            for event in shapes.start_events():
                await response.write(event)
            pieces = []
            try:
                while tokens := await stream.next_tokens():
                    pieces.append(decode(tokens))
                    await response.write(shapes.delta_event(pieces[-1]))
            except RequestAborted:
                await response.write(shapes._event("error", code="ServiceUnavailableError",
                                                   message="The request was aborted.",
                                                   param=None))
                await response.write_eof()
                return response
            text = "".join(pieces)
            status, use = finish(text)
            for event in shapes.end_events(text, status, use):
                await response.write(event)
            await response.write_eof()
            return response
        except RequestAborted as exc:
            raise ApiError(503, "The request was aborted: the replica is shutting down.",
                           "ServiceUnavailableError") from exc


async def retrieve_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}``: a stored response, from this replica only."""
    response_id = request.match_info["response_id"]
    stored = request.app[STORE_KEY].get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return web.json_response(stored.body)


async def cancel_response(request: web.Request) -> web.Response:
    """``POST /v1/responses/{response_id}/cancel``: only background responses can be cancelled."""
    response_id = request.match_info["response_id"]
    if request.app[STORE_KEY].get(response_id) is None:
        raise _not_found(response_id)
    raise ApiError(400, "Cannot cancel a synchronous response.", "invalid_request_error",
                   "response_id")


# --------------------------------------------------------------------------- Anthropic Messages


def _anthropic_prompt(replica: SimReplica, body: Mapping[str, Any]) -> tuple[list[int], int]:
    """The prompt token ids and ``max_tokens`` (required, > 0, as vLLM's pydantic model says)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ApiError(400, "Model is required", param="model")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ApiError(400, "max_tokens: a positive integer is required", param="max_tokens")
    try:
        messages = anthropic_messages(body)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    prompt = _chat_prompt(replica, messages, True)
    return prompt, _max_tokens(replica, max_tokens, len(prompt), "max_tokens")


async def create_message(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    adapter = replica.resolve_model(body.get("model"))
    prompt, max_tokens = _anthropic_prompt(replica, body)
    stream = _submit(replica, prompt, max_tokens, adapter, _cache_salt(body),
                     request.headers.get("X-Request-Id"), _priority(body))
    shapes = MessageShapes(body["model"])
    decode = replica.tokenizer.decode
    async with _aborting_on_exit(replica, stream):
        try:
            if not body.get("stream"):
                text = await _collect(stream, decode)
                use = anthropic_usage(stream.prompt_tokens, stream.generated,
                                      _cached(replica, stream))
                return web.json_response(shapes.full(text, "max_tokens", use))
            response = await _open_sse(request)
            # vLLM converts its chat stream, whose first event comes with the first token:
            # message_start goes out then, not before prefill (see ``server._generate``).
            starting = True
            try:
                while tokens := await stream.next_tokens():
                    if starting:
                        starting = False
                        usage_now = anthropic_usage(stream.prompt_tokens, 0, None)
                        for event in shapes.start_events(usage_now):
                            await response.write(event)
                    await response.write(shapes.delta_event(decode(tokens)))
            except RequestAborted:
                await response.write(sse_event("error", anthropic_error(
                    "internal_error", "The request was aborted: the replica is shutting down.")))
                await response.write_eof()
                return response
            use = anthropic_usage(stream.prompt_tokens, stream.generated,
                                  _cached(replica, stream))
            for event in shapes.end_events("max_tokens", use):
                await response.write(event)
            await response.write_eof()
            return response
        except RequestAborted as exc:
            raise ApiError(503, "The request was aborted: the replica is shutting down.",
                           "ServiceUnavailableError") from exc


async def count_message_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    replica.resolve_model(body.get("model"))
    try:
        messages = anthropic_messages(body)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    count = len(_chat_prompt(replica, messages, True))
    return web.json_response(
        {"input_tokens": count, "context_management": {"original_input_tokens": count}}
    )


# --------------------------------------------------------------------------- embeddings, detokenize


def _embedding_inputs(replica: SimReplica, value: Any, add_special: bool) -> list[list[int]]:
    """``input``: a string, strings, token ids, or lists of token ids (vLLM's four forms)."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [replica.tokenizer.encode(value, add_special_tokens=add_special)]
    if is_ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        return [replica.tokenizer.encode(x, add_special_tokens=add_special) for x in value]
    if isinstance(value, list) and value and all(is_ids(x) for x in value):
        return [list(x) for x in value]
    raise ApiError(400, "input must be a string, an array of strings, an array of token ids, "
                   "or an array of token-id arrays.", param="input")


async def embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    replica.resolve_model(body.get("model"))
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be 'float' or 'base64', got {encoding!r}.",
                       param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = DEFAULT_EMBEDDING_DIMENSIONS
    elif isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise ApiError(400, "dimensions must be a positive integer.", param="dimensions")
    inputs = _embedding_inputs(replica, body.get("input"),
                               bool(body.get("add_special_tokens", True)))
    for ids in inputs:
        if len(ids) > replica.max_model_len:
            raise ApiError(400, f"This model's maximum context length is "
                           f"{replica.max_model_len} tokens. However, you requested "
                           f"{len(ids)} tokens in the input for embedding generation. "
                           "Please reduce the length of the input.", param="input")
    data = [embedding_data(i, embedding_vector(ids, dimensions), encoding)
            for i, ids in enumerate(inputs)]
    model = body.get("model") or replica.config.model
    return web.json_response(embedding_response(model, data, sum(len(x) for x in inputs)))


async def detokenize(request: web.Request) -> web.Response:
    """``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"prompt": text}``."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    replica.resolve_model(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise ApiError(400, "tokens must be an array of non-negative integers.", param="tokens")
    return web.json_response({"prompt": replica.tokenizer.decode(tokens)})


# --------------------------------------------------------------------------- mounting


@web.middleware
async def _anthropic_envelope(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """vLLM answers errors on ``/v1/messages*`` in Anthropic's envelope (``translate_error``)."""
    if not request.path.startswith("/v1/messages"):
        return await handler(request)
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(anthropic_error(exc.err_type, exc.message), status=exc.status)


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    app[STORE_KEY] = ResponseStore()
    yield


def add_api_routes(app: web.Application) -> None:
    """Mount these endpoints (and the Anthropic error envelope) on a simulated replica's app."""
    app.middlewares.append(_anthropic_envelope)
    app.cleanup_ctx.append(_store_ctx)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_message_tokens)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/detokenize", detokenize)


