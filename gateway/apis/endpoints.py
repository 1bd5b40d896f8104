"""The aiohttp handlers of the APIs in ``gateway/apis/``, and where they are mounted.

vLLM endpoints the gateway does not route (audio uploads, the realtime websocket, token-in
generation, batch chat) answer 501 ``not_routed`` in the OpenAI envelope, naming the endpoint;
engine-control endpoints (LoRA loading, cache reset, sleep, profiling, weight updates) are not
exposed to tenants at all (404): the gateway manages adapters itself (``/admin/adapters``).
"""

from __future__ import annotations

from aiohttp import web

from gateway.apis import stored_responses
from gateway.apis.kinds import (
    COUNT_TOKENS,
    DETOKENIZE,
    EMBEDDINGS,
    MESSAGES,
    POOLING,
    RENDER,
    RESPONSES,
    TOKENIZE,
)
from gateway.errors import GatewayError
from gateway.request.handler import handle
from gateway.request_body import request_id_of

#: Stable error code of a vLLM endpoint fleetgate does not route.
NOT_ROUTED = "not_routed"

#: vLLM endpoints that are served by an engine but not routed by the gateway (method, path).
NOT_ROUTED_PATHS = (
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
    ("GET", "/v1/realtime"),
    ("POST", "/v1/chat/completions/batch"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/generative_scoring"),
    ("POST", "/v1/systemone"),
    ("POST", "/cohere/v2/chat"),
    ("POST", "/invocations"),  # SageMaker's one-path dispatch: call the API's own path instead
    ("GET", "/tokenizer_info"),
)


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    return await handle(request, RESPONSES)


async def create_message(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages`` (Anthropic)."""
    return await handle(request, MESSAGES)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """``POST /v1/embeddings``."""
    return await handle(request, EMBEDDINGS)


async def tokenize(request: web.Request) -> web.StreamResponse:
    """``POST /tokenize``."""
    return await handle(request, TOKENIZE)


async def detokenize(request: web.Request) -> web.StreamResponse:
    """``POST /detokenize``."""
    return await handle(request, DETOKENIZE)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages/count_tokens`` (Anthropic)."""
    return await handle(request, COUNT_TOKENS)


async def pooling(request: web.Request) -> web.StreamResponse:
    """``/pooling``, ``/classify``, ``/score``, ``/rerank``, ... (vLLM's pooling endpoints)."""
    return await handle(request, POOLING[request.path])


async def render(request: web.Request) -> web.StreamResponse:
    """``…/render`` and ``…/derender`` of chat, completions, Messages and Responses."""
    return await handle(request, RENDER[request.path])


async def not_routed(request: web.Request) -> web.Response:
    """A vLLM endpoint the gateway does not route: 501, saying so."""
    message = (
        f"{request.method} {request.path} is served by vLLM engines but not routed by fleetgate "
        "(docs/api.md lists what is). Call a replica directly for it."
    )
    return GatewayError(501, NOT_ROUTED, message).response(request_id_of(request))


def add_api_routes(app: web.Application) -> None:
    """Mount every API beyond chat, completions and models."""
    app.router.add_post("/v1/responses", create_response)
    for path in RENDER:  # before /v1/responses/{response_id}, which would take "render"
        app.router.add_post(path, render)
    stored_responses.add_routes(app)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    for path in POOLING:
        app.router.add_post(path, pooling)
    for method, path in NOT_ROUTED_PATHS:
        app.router.add_route(method, path, not_routed)
