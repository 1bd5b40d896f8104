"""Errors in the OpenAI envelope, with stable ``code`` strings.

Every error the gateway returns goes out as ``{"error": {"message", "type", "code", "param"}}``,
the shape the official ``openai`` client parses. ``code`` is stable (clients and dashboards key on
it) and doubles as the ``code`` label of ``fleetgate_errors_total``.
"""

from __future__ import annotations

import json
from typing import Final

from aiohttp import web

# Stable error codes. Never rename one: clients, alerts and dashboards match on them.
INVALID_JSON: Final = "invalid_json"
INVALID_REQUEST: Final = "invalid_request"
INVALID_API_KEY: Final = "invalid_api_key"
MODEL_NOT_FOUND: Final = "model_not_found"
NOT_FOUND: Final = "not_found"
BODY_TOO_LARGE: Final = "request_too_large"
BODY_TIMEOUT: Final = "request_timeout"
RATE_LIMITED: Final = "rate_limit_exceeded"
NO_HEALTHY_REPLICA: Final = "no_healthy_replica"
UPSTREAM_TIMEOUT: Final = "upstream_timeout"
UPSTREAM_ERROR: Final = "upstream_error"
SHUTTING_DOWN: Final = "shutting_down"
POLICY_INVALID: Final = "policy_invalid"
NO_POLICY_FILE: Final = "no_policy_file"
NO_ROUTE: Final = "no_route"
INTERNAL_ERROR: Final = "internal_error"
ADMIN_DISABLED: Final = "admin_disabled"
NO_ADAPTER_SLOT: Final = "no_adapter_slot"
ADAPTER_LOAD_FAILED: Final = "adapter_load_failed"
INVALID_ADAPTER: Final = "invalid_adapter"
ADAPTERS_DISABLED: Final = "adapters_disabled"
UNSUPPORTED_ENCODING: Final = "unsupported_content_encoding"

#: HTTP status -> OpenAI error ``type`` (what OpenAI's own API sends for that status).
_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
    504: "api_error",
}


class GatewayError(Exception):
    """An error that becomes one OpenAI-shaped HTTP response."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}

    def envelope(self) -> dict[str, dict[str, str | None]]:
        """The JSON body: OpenAI's error envelope."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "api_error"),
                "code": self.code,
                "param": self.param,
            }
        }

    def response(self, request_id: str | None = None) -> web.Response:
        """An aiohttp response carrying the envelope (and the request id, when known)."""
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        return web.Response(
            status=self.status,
            text=json.dumps(self.envelope()),
            content_type="application/json",
            headers=headers,
        )


def bad_request(
    message: str, param: str | None = None, code: str = INVALID_REQUEST
) -> GatewayError:
    """400 for a malformed body or field."""
    return GatewayError(400, code, message, param)


def model_not_found(model: str) -> GatewayError:
    """404 for an unknown model or adapter; also for another tenant's adapter (never reveal it)."""
    return GatewayError(404, MODEL_NOT_FOUND, f"The model `{model}` does not exist.", param="model")


def shutting_down() -> GatewayError:
    """503 for a request that reaches a gateway on its way down: retry at once (another
    gateway, or this one's replacement, takes it)."""
    return GatewayError(
        503,
        SHUTTING_DOWN,
        "The gateway is shutting down; retry the request.",
        headers={"Retry-After": "1"},
    )
