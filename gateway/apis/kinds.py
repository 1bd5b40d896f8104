"""The ``RequestKind`` of each API beyond chat and completions (``gateway/request/kinds.py``).

Each goes through the same route → forward → account path as chat. What differs is here: the
body check, the prompt to route on, the upstream body (the tenant's ``cache_salt``; no
``stream_options``, which these APIs do not take), the usage shape, the error envelope, and for
the Responses API the replica a follow-up is pinned to.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from aiohttp import web

from gateway.apis import anthropic, responses, usage
from gateway.apis.background_responses import is_background_start
from gateway.errors import bad_request
from gateway.policy_view import Tenant
from gateway.proxy import UpstreamOutcome
from gateway.request.forward import ENGINE_ONLY_FIELDS, without_engine_only_fields
from gateway.request.kinds import Body, RequestKind, whole_input_tokens
from gateway.request_body import validate_common
from gateway.state import GatewayState
from gateway.stream_end import stream_end
from routing.contracts import PromptTokenizer, TokenizedPrompt
from routing.types import ReplicaId


def _encode(value: Any) -> bytes:
    try:
        return msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError):
        return json.dumps(value).encode()


def salted_payload(body: Body, raw: bytes, tenant: Tenant) -> tuple[bytes, bool]:
    """The body with the tenant's ``cache_salt`` (any client salt replaced or dropped)."""
    out = without_engine_only_fields(body)
    if tenant.cache_salt:
        out["cache_salt"] = tenant.cache_salt
    else:
        out.pop("cache_salt", None)  # the gateway owns the salt: never trust the client's
    return _encode(out), False


def unchanged_payload(body: Body, raw: bytes, tenant: Tenant) -> tuple[bytes, bool]:
    """The client's bytes as they are (tokenize, detokenize and the render endpoints prefill
    nothing, so no prefix cache to salt), less any ``cache_salt`` the client sent: the gateway
    owns the salt, and a tenant's derived salt is no secret."""
    if "cache_salt" in body or not ENGINE_ONLY_FIELDS.isdisjoint(body):
        out = without_engine_only_fields(body)
        out.pop("cache_salt", None)
        return _encode(out), False
    return raw, False


async def _no_prompt(tokenizer: PromptTokenizer, model: str, body: Body) -> TokenizedPrompt:
    return TokenizedPrompt(token_ids=[])


# --------------------------------------------------------------------------- Responses


def _with_response_id(body: dict[str, Any]) -> dict[str, Any]:
    # The gateway owns vLLM's request_id here (it becomes the response id): it must know the id
    # before the answer, and a client's own could collide with another tenant's.
    return {**body, "request_id": responses.new_response_id()}


async def _previous_response_home(
    gw: GatewayState, tenant: Tenant, body: Body
) -> ReplicaId | None:
    previous = body.get("previous_response_id")
    if previous is None:
        return None
    return await responses.home_replica(gw, gw.response_affinity, tenant.name, str(previous))


async def _remember_home(gw: GatewayState, tenant: Tenant, body: Body, replica: ReplicaId) -> None:
    if body.get("store", True) is not False:
        await responses.remember(gw.response_affinity, str(body["request_id"]), replica,
                                 tenant.name)


def _background_response(
    body: Body, outcome: UpstreamOutcome, answer: web.StreamResponse | None
) -> str | None:
    """The id of a background response the engine is still generating (accounted when it
    ends, ``gateway/apis/background_responses.py``)."""
    if outcome.status != 200 or body.get("background") is not True:
        return None
    if not isinstance(answer, web.Response):
        # Streamed: vLLM generates a background response in its own task, which a client
        # hanging up does not stop (it may fetch the result later). A stream that ended
        # without the final usage is watched until the response ends.
        return str(body["request_id"]) if outcome.usage is None else None
    if not answer.body:
        return None
    try:
        parsed = json.loads(bytes(answer.body))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if not is_background_start(body, parsed):
        return None
    return str(parsed.get("id") or body["request_id"])


RESPONSES = RequestKind(
    "responses",
    "/v1/responses",
    responses.validate,
    responses.prompt,
    prepare=_with_response_id,
    payload=salted_payload,
    usage=usage.from_responses,
    stream_error=responses.stream_error_event,
    pinned_replica=_previous_response_home,
    served_by=_remember_home,
    finishes_later=_background_response,
    # Any output delta is a first token: text, reasoning, a tool call's arguments, a refusal.
    # The engine has prefilled the prompt once one comes (a reasoning model's text comes late).
    first_token_marker=(
        b'"response.output_text.delta"',
        b'"response.reasoning_text.delta"',
        b'"response.reasoning_summary_text.delta"',
        b'"response.function_call_arguments.delta"',
        b'"response.refusal.delta"',
    ),
    # The Responses stream ends with the response's final state (vLLM sends no [DONE]).
    stream_end=stream_end("response.completed", "response.incomplete", "response.failed"),
)


# --------------------------------------------------------------------------- Anthropic Messages


MESSAGES = RequestKind(
    "messages",
    "/v1/messages",
    anthropic.validate,
    anthropic.prompt,
    payload=salted_payload,
    usage=usage.from_anthropic,
    error_response=anthropic.error_response,
    stream_error=anthropic.stream_error_event,
    stream_end=stream_end("message_stop"),
)


# --------------------------------------------------------------------------- pooling, tokenizer


def _chat_messages(value: Any) -> bool:
    """A conversation (a non-empty array of message objects) or a batch of them."""
    if not isinstance(value, list) or not value:
        return False
    return all(isinstance(x, dict) for x in value) or all(
        isinstance(x, list) and x and all(isinstance(m, dict) for m in x) for x in value
    )


def _validate_embeddings(body: Body) -> None:
    """vLLM's forms: ``input`` as text, token ids or chat messages (one conversation or a
    batch), or ``messages`` instead of ``input`` (multimodal embedding models)."""
    validate_common(body)
    if "messages" in body and "input" not in body:
        if _chat_messages(body["messages"]):
            return
        raise bad_request(
            "`messages` must be a non-empty array of message objects (or a batch of them).",
            "messages",
        )
    value = body.get("input")
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and (
        all(isinstance(x, str) for x in value)
        or all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        or all(isinstance(x, list) for x in value)
        or _chat_messages(value)
    ):
        return
    raise bad_request(
        "`input` must be a string, an array of strings, token ids, arrays of token ids, or "
        "chat messages (or give `messages` instead).",
        "input",
    )


def _validate_tokenize(body: Body) -> None:
    validate_common(body)
    if not isinstance(body.get("prompt"), str) and not isinstance(body.get("messages"), list):
        raise bad_request("Either `prompt` (a string) or `messages` (an array) is required.",
                          "prompt")


def _validate_detokenize(body: Body) -> None:
    validate_common(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise bad_request("`tokens` must be an array of token ids.", "tokens")


EMBEDDINGS = RequestKind(
    "embeddings", "/v1/embeddings", _validate_embeddings, _no_prompt,
    prefix_routed=False, streams=False,
    payload=salted_payload, usage=usage.from_pooling, budget_prompt=whole_input_tokens,
)
TOKENIZE = RequestKind(
    "tokenize", "/tokenize", _validate_tokenize, _no_prompt, prefix_routed=False, streams=False,
    payload=unchanged_payload,
)
DETOKENIZE = RequestKind(
    "detokenize", "/detokenize", _validate_detokenize, _no_prompt,
    prefix_routed=False, streams=False,
    payload=unchanged_payload,
)



def _validate_model_only(body: Body) -> None:
    validate_common(body)


def pooling_kind(path: str) -> RequestKind:
    """A vLLM pooling endpoint (score, rerank, classify, ...): routed by load, with the
    tenant's ``cache_salt`` as embeddings are. vLLM prefix-caches decoder pooling models
    (Qwen3 embedding and reranker models, for one) and takes the salt on every pooling
    request: unsalted, two tenants scoring the same documents would share cached blocks and
    could time each other's prompts."""
    return RequestKind(
        f"pooling:{path}", path, _validate_model_only, _no_prompt,
        prefix_routed=False, streams=False,
        payload=salted_payload, usage=usage.from_pooling, budget_prompt=whole_input_tokens,
    )


#: vLLM's other pooling endpoints, JSON in and out, routed like embeddings.
POOLING_PATHS = ("/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                 "/v2/rerank", "/v2/embed")
POOLING = {path: pooling_kind(path) for path in POOLING_PATHS}


def render_kind(path: str) -> RequestKind:
    """vLLM's ``…/render`` and ``…/derender`` (a request's prompt as the engine would build it,
    and back): routed by load to a replica of the model, body untouched; the Messages one
    answers errors in Anthropic's envelope."""
    return RequestKind(
        f"render:{path}", path, _validate_model_only, _no_prompt,
        prefix_routed=False, streams=False, payload=unchanged_payload,
        error_response=anthropic.error_response if path.startswith("/v1/messages") else None,
    )


RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
                "/v1/responses/render", "/v1/chat/completions/derender",
                "/v1/completions/derender")
RENDER = {path: render_kind(path) for path in RENDER_PATHS}


def _validate_count_tokens(body: Body) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", "model")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise bad_request("`messages` must be a non-empty array.", "messages")


COUNT_TOKENS = RequestKind(
    "messages_count_tokens", "/v1/messages/count_tokens", _validate_count_tokens, _no_prompt,
    prefix_routed=False, streams=False, payload=unchanged_payload,
    error_response=anthropic.error_response,
)
