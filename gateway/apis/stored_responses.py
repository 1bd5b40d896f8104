"""``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: to the replica
that stored the response (``gateway/apis/responses.py`` explains why).

vLLM 0.32 serves ``GET`` and ``/cancel``; it has no ``DELETE`` (the engine answers 405, passed on
to the client as it is). The engine's answer is relayed as it is, status and body.
"""

from __future__ import annotations

import contextlib
import logging

import aiohttp
from aiohttp import web

from gateway import errors
from gateway.apis import responses
from gateway.auth import authenticate
from gateway.errors import GatewayError
from gateway.request_body import request_id_of
from gateway.state import GATEWAY
from gateway.tracing import upstream_trace_headers

log = logging.getLogger(__name__)

#: The ``route`` label of these calls in ``fleetgate_errors_total`` (they match no policy route).
STORED_RESPONSES_ROUTE = "stored_responses"

#: Response headers not copied from the engine (hop-by-hop, length, ours).
_DROP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date",
                   "server", "x-request-id", "content-encoding"})


async def relay_to_home(request: web.Request, upstream_suffix: str = "") -> web.StreamResponse:
    """Send this call to the response's home replica and relay the answer.

    An event stream (``GET ...?stream=true`` of a background response, which vLLM streams while
    it generates) is relayed event by event, each read bounded by ``upstream_timeout_s`` rather
    than the whole answer, so a long generation is neither held back nor cut off.
    """
    gw = request.app[GATEWAY]
    request_id = request_id_of(request)
    response_id = request.match_info["response_id"]
    try:
        tenant = authenticate(request, gw.policy)
        replica_id = await responses.home_replica(
            gw, gw.response_affinity, tenant.name, response_id, param=None
        )
        replica = gw.registry.get(replica_id)
        assert replica is not None  # home_replica checked it
        url = f"{replica.url}/v1/responses/{response_id}{upstream_suffix}"
        timeout = aiohttp.ClientTimeout(
            sock_read=gw.config.upstream_timeout_s, sock_connect=gw.config.connect_timeout_s
        )
        try:
            async with gw.http().request(
                request.method,
                url,
                params=request.query,
                timeout=timeout,
                headers={"X-Request-Id": request_id, **upstream_trace_headers(request.headers)},
            ) as resp:
                headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
                headers["X-Request-Id"] = request_id
                if resp.status == 200 and resp.content_type == "text/event-stream":
                    return await _relay_events(request, resp, headers)
                body = await resp.read()
        except TimeoutError:
            raise GatewayError(
                504, errors.UPSTREAM_TIMEOUT, f"Replica {replica_id} did not answer in time."
            ) from None
        except aiohttp.ClientError as exc:
            raise GatewayError(
                502,
                errors.UPSTREAM_ERROR,
                f"Replica {replica_id}, which stored response '{response_id}', is unreachable "
                f"({type(exc).__name__}).",
                headers={"Retry-After": "1"},
            ) from None
    except GatewayError as err:
        gw.metrics.errors.labels(STORED_RESPONSES_ROUTE, err.code).inc()
        return err.response(request_id)
    return web.Response(status=resp.status, body=body, headers=headers)


async def _relay_events(
    request: web.Request, resp: aiohttp.ClientResponse, headers: dict[str, str]
) -> web.StreamResponse:
    """The engine's event stream, chunk by chunk, until it ends or the client leaves."""
    out = web.StreamResponse(status=200, headers=headers)
    await out.prepare(request)
    try:
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
    except (aiohttp.ClientError, TimeoutError):
        # Started already: no error status can be sent; ending the stream early tells the client.
        log.warning("stored response stream from %s ended early", resp.url.host)
    except ConnectionResetError:
        pass  # the client left: closing the upstream response stops the engine's stream
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof()
    return out


async def retrieve(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{response_id}``."""
    return await relay_to_home(request)


async def delete(request: web.Request) -> web.StreamResponse:
    """``DELETE /v1/responses/{response_id}`` (vLLM 0.32 answers 405: it cannot delete)."""
    return await relay_to_home(request)


async def cancel(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses/{response_id}/cancel`` (background responses only, in vLLM)."""
    return await relay_to_home(request, "/cancel")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
