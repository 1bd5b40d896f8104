"""The OpenAI-compatible endpoints, as vLLM serves them."""

from __future__ import annotations

import time

from aiohttp import web

from gateway.adapters import model_cards
from gateway.auth import authenticate
from gateway.errors import GatewayError, model_not_found
from gateway.policy_view import Tenant
from gateway.request.handler import handle
from gateway.request.kinds import CHAT, COMPLETION
from gateway.request.route import UNROUTED
from gateway.request_body import request_id_of
from gateway.state import GATEWAY, GatewayState

#: Reported as ``created`` for every model: the gateway's start, stable across calls.
_STARTED = int(time.time())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await handle(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await handle(request, COMPLETION)


def _model_card(model_id: str, parent: str | None, max_model_len: int | None) -> dict[str, object]:
    card: dict[str, object] = {
        "id": model_id,
        "object": "model",
        "created": _STARTED,
        "owned_by": "fleetgate",
        "root": model_id,
        "parent": parent,
        "permission": [],
    }
    if max_model_len is not None:  # vLLM's card has it; clients size prompts from it
        card["max_model_len"] = max_model_len
    return card


def _cards(gw: GatewayState, models: list[tuple[str, str | None]]) -> list[dict[str, object]]:
    """Model cards; an adapter has its base model's ``max_model_len``."""
    return [
        _model_card(model_id, parent, gw.registry.max_model_len(parent or model_id))
        for model_id, parent in models
    ]


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: base models and the adapters this tenant may use (with ``parent``)."""
    gw = request.app[GATEWAY]
    request_id = request_id_of(request)
    try:
        tenant = authenticate(request, gw.policy)
    except GatewayError as err:
        gw.metrics.errors.labels(UNROUTED, err.code).inc()
        return err.response(request_id)
    data = _tenant_cards(gw, tenant)
    return web.json_response({"object": "list", "data": data}, headers={"X-Request-Id": request_id})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: one card of the list, or 404 ``model_not_found`` (the same
    for a model that does not exist and for another tenant's adapter)."""
    gw = request.app[GATEWAY]
    request_id = request_id_of(request)
    model = request.match_info["model"]
    try:
        tenant = authenticate(request, gw.policy)
        card = next((c for c in _tenant_cards(gw, tenant) if c["id"] == model), None)
        if card is None:
            raise model_not_found(model)
    except GatewayError as err:
        gw.metrics.errors.labels(UNROUTED, err.code).inc()
        return err.response(request_id)
    return web.json_response(card, headers={"X-Request-Id": request_id})


def _tenant_cards(gw: GatewayState, tenant: Tenant) -> list[dict[str, object]]:
    if gw.adapters is not None:  # the registry's catalog, runtime additions included
        return _cards(gw, list(model_cards(gw, tenant)))
    if gw.policy.source is not None:
        bases = sorted(gw.policy.known_models)
        adapters = sorted((a.name, a.base_model) for a in gw.policy.adapters_for(tenant))
    else:
        bases = sorted(gw.registry.base_models())
        adapters = sorted(gw.registry.served_adapters.items())
    return _cards(gw, [(m, None) for m in bases] + [(name, base) for name, base in adapters])
