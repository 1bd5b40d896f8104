"""An error answer that is not JSON (an ingress's HTML 502 page, a sidecar's plain text) reaches
the client in the OpenAI envelope, with the replica's status, so SDKs raise their usual typed
error with a readable message instead of failing to parse it. JSON errors (vLLM's own) are
relayed as the engine sent them."""

from __future__ import annotations

import anthropic
import openai
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from tests.integration.test_gateway_support import engine_app, serve

MODEL = "base-model"


def replica(status: int, body: str, content_type: str) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        return web.Response(
            status=status, text=body, content_type=content_type, headers={"Retry-After": "7"}
        )

    return engine_app(MODEL, {"/v1/chat/completions": chat, "/v1/messages": chat})


async def _ask(status: int, body: str, content_type: str) -> openai.APIStatusError:
    async with serve(replica(status, body, content_type)) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app, handler_cancellation=True) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            try:
                with pytest.raises(openai.APIStatusError) as raised:
                    await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}]
                    )
            finally:
                await client.close()
    return raised.value


async def test_an_html_error_page_reaches_the_client_in_the_envelope() -> None:
    page = "<html><body><h1>502 Bad Gateway</h1>\n<hr>nginx</body></html>"
    error = await _ask(502, page, "text/html")
    assert error.status_code == 502
    assert error.body["code"] == "upstream_error"
    assert error.body["message"] == (
        "The replica answered 502 with a body that is not JSON: <html><body><h1>502 Bad "
        "Gateway</h1> <hr>nginx</body></html>"
    )
    assert error.response.headers["Retry-After"] == "7"


async def test_a_json_error_of_the_engine_is_relayed_as_it_is() -> None:
    vllm_error = (
        '{"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}'
    )
    error = await _ask(400, vllm_error, "application/json")
    assert error.status_code == 400
    assert error.body == {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}


async def test_on_the_messages_api_it_is_in_anthropics_envelope() -> None:
    async with serve(replica(502, "upstream connect error", "text/plain")) as replica_url:
        spec = ReplicaSpec("r0", replica_url, models=frozenset({MODEL}))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app, handler_cancellation=True) as url:
            client = anthropic.AsyncAnthropic(base_url=url, api_key="any", max_retries=0)
            try:
                with pytest.raises(anthropic.APIStatusError) as raised:
                    await client.messages.create(
                        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                    )
            finally:
                await client.close()
    assert raised.value.status_code == 502
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["message"].endswith("not JSON: upstream connect error")
    assert raised.value.response.headers["X-Fleetgate-Error-Code"] == "upstream_error"
