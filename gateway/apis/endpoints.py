"""The aiohttp handlers of the APIs in ``gateway/apis/``, and where they are mounted."""

from __future__ import annotations

from aiohttp import web

from gateway.apis import stored_responses
from gateway.apis.kinds import DETOKENIZE, EMBEDDINGS, MESSAGES, RESPONSES, TOKENIZE
from gateway.request.handler import handle


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


def add_api_routes(app: web.Application) -> None:
    """Mount every API beyond chat, completions and models."""
    app.router.add_post("/v1/responses", create_response)
    stored_responses.add_routes(app)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
