"""Anthropic's Messages API (``POST /v1/messages``) through the gateway, as vLLM serves it.

Routed and accounted like chat: ``system`` + ``messages`` become the chat messages vLLM renders
(``routing.api_messages.anthropic_messages``), tokenized through the chat template and hashed for
prefix-aware routing. Errors on this endpoint go out in Anthropic's own envelope,
``{"type": "error", "error": {"type", "message"}}``, which the official ``anthropic`` client
parses; the stable fleetgate ``code`` rides along in the ``X-Fleetgate-Error-Code`` header.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from gateway.errors import GatewayError, bad_request
from routing.api_messages import anthropic_messages
from routing.contracts import PromptTokenizer, TokenizedPrompt
from routing.template_inputs import anthropic_tools, template_variables

#: HTTP status -> Anthropic's error ``type`` (https://docs.anthropic.com/en/api/errors).
_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_envelope(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for ``status``."""
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"),
                                       "message": message}}


def error_response(err: GatewayError, request_id: str | None = None) -> web.Response:
    """A gateway error on ``/v1/messages``, in Anthropic's envelope."""
    headers = dict(err.headers)
    headers["X-Fleetgate-Error-Code"] = err.code
    if request_id:
        headers["X-Request-Id"] = request_id
    return web.Response(status=err.status, text=json.dumps(error_envelope(err.status, err.message)),
                        content_type="application/json", headers=headers)


def stream_error_event(err: GatewayError, last_event: bytes) -> bytes:
    """The in-band error of a stream that already started, as Anthropic streams it (its events
    carry no sequence number: ``last_event`` is not read)."""
    body = json.dumps(error_envelope(err.status, err.message))
    return f"event: error\ndata: {body}\n\n".encode()


def validate(body: Mapping[str, Any]) -> None:
    """The fields the gateway reads (vLLM checks the rest): model, max_tokens, messages, stream."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", "model")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request("`max_tokens` is required and must be a positive integer.",
                          "max_tokens")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("`stream` must be a boolean.", "stream")
    try:
        anthropic_messages(body)
    except ValueError as exc:
        raise bad_request(f"Invalid request: {exc}", str(exc).split(":", 1)[0]) from None


async def prompt(tokenizer: PromptTokenizer, model: str, body: Mapping[str, Any]) -> (
    TokenizedPrompt
):
    """What vLLM renders for this request: its chat messages through the chat template."""
    variables = template_variables(
        tools=anthropic_tools(body.get("tools")),
        chat_template_kwargs=body.get("chat_template_kwargs"),
        reasoning_effort=_reasoning_effort(body),
    )
    return await tokenizer.tokenize_chat(model, anthropic_messages(body), **variables)


def _reasoning_effort(body: Mapping[str, Any]) -> str | None:
    """vLLM's ``reasoning_effort`` for a Messages request: ``output_config.effort``, and "none"
    when thinking is disabled (vLLM probes each model for "none" or "low"; "none" is the usual)."""
    thinking, config = body.get("thinking"), body.get("output_config")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        return "none"
    if isinstance(config, Mapping) and isinstance(config.get("effort"), str):
        return config["effort"]
    return None
