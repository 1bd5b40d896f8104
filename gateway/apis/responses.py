"""OpenAI's Responses API (``/v1/responses``) through the gateway, as vLLM serves it.

A new response is routed like chat: ``instructions`` + ``input`` become the chat messages vLLM
renders (``routing.api_messages.responses_messages``), tokenized through the chat template and
hashed for prefix-aware routing. The gateway sets vLLM's ``request_id`` (which vLLM uses as the
response's ``id``) so it knows the id before the answer, and records which replica answered
(``gateway/response_affinity.py``). vLLM keeps stored responses in the engine that made them:

- ``previous_response_id`` goes to that replica, skipping the routing policy (its prompt is the
  stored conversation plus the new input, held only there);
- ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go there too;
- an id the gateway never saw (or another tenant's) is a 404; one whose replica has left the
  fleet is a 404 saying so (the stored conversation went with it).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from gateway.errors import GatewayError, bad_request
from gateway.response_affinity import (
    ResponseAffinity,
    ResponseAffinityUnavailable,
    ResponseHome,
)
from gateway.state import GatewayState
from routing.api_messages import responses_messages
from routing.contracts import PromptTokenizer, TokenizedPrompt
from routing.template_inputs import responses_tools, template_variables
from routing.types import ReplicaId

#: Stable error codes of this API (also ``fleetgate_errors_total`` labels).
RESPONSE_NOT_FOUND = "response_not_found"
RESPONSE_REPLICA_GONE = "response_replica_gone"
RESPONSE_LOOKUP_UNAVAILABLE = "response_lookup_unavailable"


def new_response_id() -> str:
    """An id in vLLM's own form (``resp_`` + 32 hex digits), set as the request's ``request_id``."""
    return f"resp_{uuid.uuid4().hex}"


def validate(body: Mapping[str, Any]) -> None:
    """The fields the gateway reads: model, stream, input, instructions, previous_response_id."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", "model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("`stream` must be a boolean.", "stream")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_request("`previous_response_id` must be a non-empty string.",
                          "previous_response_id")
    try:
        responses_messages(body)
    except ValueError as exc:
        raise bad_request(f"Invalid request: {exc}", str(exc).split(":", 1)[0]) from None


async def prompt(tokenizer: PromptTokenizer, model: str, body: Mapping[str, Any]) -> (
    TokenizedPrompt
):
    """``instructions`` + ``input`` as vLLM renders them (a follow-up's history is not known)."""
    reasoning = body.get("reasoning")
    variables = template_variables(
        tools=responses_tools(body.get("tools")),
        chat_template_kwargs=body.get("chat_template_kwargs"),
        reasoning_effort=reasoning.get("effort") if isinstance(reasoning, Mapping) else None,
    )
    return await tokenizer.tokenize_chat(model, responses_messages(body), **variables)


def not_found(response_id: str, param: str | None = "previous_response_id") -> GatewayError:
    return GatewayError(
        404, RESPONSE_NOT_FOUND, f"Response with id '{response_id}' not found.", param,
    )


async def home_replica(
    gw: GatewayState,
    affinity: ResponseAffinity,
    tenant: str,
    response_id: str,
    param: str | None = "previous_response_id",
) -> ReplicaId:
    """The replica that stored ``response_id``; 404 if unknown, another tenant's, or gone (the
    error's ``param`` is ``param``: None for ``/v1/responses/{id}``, where no field named it);
    503 if the shared store cannot be read."""
    try:
        home = await affinity.home_of(response_id)
    except ResponseAffinityUnavailable:
        raise GatewayError(
            503, RESPONSE_LOOKUP_UNAVAILABLE,
            f"Cannot look up which replica stored response '{response_id}' right now (the "
            "gateways' shared store is unreachable); retry shortly.",
            headers={"Retry-After": "1"},
        ) from None
    if home is None or home.tenant != tenant:  # never reveal another tenant's response
        raise not_found(response_id, param)
    if gw.registry.get(home.replica) is None:
        raise GatewayError(
            404, RESPONSE_REPLICA_GONE,
            f"Response with id '{response_id}' was stored by replica {home.replica}, which has "
            "left the fleet; vLLM keeps stored responses in the engine's memory, so it is gone. "
            "Send the whole conversation as `input` instead of `previous_response_id`.",
            param,
        )
    return home.replica


async def remember(
    affinity: ResponseAffinity, response_id: str, replica: ReplicaId, tenant: str
) -> None:
    await affinity.remember(response_id, ResponseHome(replica, tenant))



#: An event's own sequence number: the last one on its data line (a model's text holding the
#: same words is inside a JSON string, where its quotes are escaped, so it never reads as this).
_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)')


def stream_error_event(err: GatewayError, last_event: bytes) -> bytes:
    """The in-band error of a Responses stream that already started, as the Responses API
    streams one (an ``error`` event: type, code, message, param, and the sequence number after
    ``last_event``'s, the last event relayed, so a client ordering events by it keeps this one
    last; left out where the engine numbered none)."""
    payload: dict[str, object] = {
        "type": "error", "code": err.code, "message": err.message, "param": None,
    }
    numbers = _SEQUENCE_NUMBER.findall(last_event)
    if numbers:
        payload["sequence_number"] = int(numbers[-1]) + 1
    return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
