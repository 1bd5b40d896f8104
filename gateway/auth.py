"""API keys: the caller's tenant, and the admin key."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from gateway import errors
from gateway.errors import GatewayError
from gateway.policy_view import GatewayPolicy, Tenant, sha256_hex

log = logging.getLogger(__name__)

#: What ``bearer_key`` returns for an ``Authorization`` header that is present but is not
#: ``Bearer <key>`` (``Basic ...``, a bare key): no tenant's key, so such a request is 401, never
#: anonymous. Not a string any client could send as a key (it has a NUL byte).
MALFORMED_AUTHORIZATION = "\x00malformed-authorization"


#: The headers a key may come in.
_KEY_HEADERS = ("Authorization", "api-key", "x-api-key")


def bearer_key(request: web.Request) -> str | None:
    """The key of ``Authorization: Bearer <key>`` (also ``api-key:``, and ``x-api-key:``, which
    the official ``anthropic`` client sends), or None when the request carries none.

    An ``Authorization`` header that is there but not ``Bearer <key>`` gives
    ``MALFORMED_AUTHORIZATION`` unless ``api-key`` / ``x-api-key`` carries a key: a client that
    meant to authenticate gets 401 instead of silently acting as the anonymous tenant.
    """
    if _repeated_key_header(request) is not None:
        # Which one counts is ambiguous: a proxy in front that reads the last one would
        # disagree with the gateway (the first) about who is calling. Refused, as is a
        # repeated priority header.
        return MALFORMED_AUTHORIZATION
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    other = request.headers.get("api-key") or request.headers.get("x-api-key")
    if other:
        return other
    if header.strip():
        return MALFORMED_AUTHORIZATION
    return None


def authenticate(request: web.Request, policy: GatewayPolicy) -> Tenant:
    """The tenant this request acts for; 401 if the key is missing, unknown or malformed (open
    access, without declared tenants, takes any)."""
    key = bearer_key(request)
    tenant = policy.tenant_for_key(key)
    if tenant is None:
        if key == MALFORMED_AUTHORIZATION and _repeated_key_header(request):
            raise GatewayError(
                401,
                errors.INVALID_API_KEY,
                f"The API key header {_repeated_key_header(request)} was sent more than once: "
                "send it once.",
                headers={"WWW-Authenticate": "Bearer"},
            )
        raise unknown_key()
    return tenant


def _repeated_key_header(request: web.Request) -> str | None:
    """The first key header the request sends more than once (``Authorization``, ...)."""
    return next((n for n in _KEY_HEADERS if len(request.headers.getall(n, ())) > 1), None)


def still_authorised(request: web.Request, policy: GatewayPolicy, tenant: Tenant) -> None:
    """401, as for an unknown key, unless the request's key still names ``tenant`` under
    ``policy``: a request that waited across a reload (flow control's queue) must not be served
    for a key revoked, or moved to another tenant, meanwhile."""
    if authenticate(request, policy).name != tenant.name:
        raise unknown_key()


def unknown_key() -> GatewayError:
    """401 ``invalid_api_key``: the answer to a key no tenant holds."""
    return GatewayError(
        401,
        errors.INVALID_API_KEY,
        "Incorrect or missing API key.",
        headers={"WWW-Authenticate": "Bearer"},
    )


def warn_if_admin_key_is_a_tenants(admin_key: str | None, policy: GatewayPolicy) -> None:
    """Log an error when ``--admin-key`` is also a tenant's key: it opens no admin API then
    (``is_admin``), and the operator should hear why."""
    if admin_key is None:
        return
    tenant = policy.tenants_by_key_sha256.get(sha256_hex(admin_key))
    if tenant is not None:
        log.error(
            "the admin key (--admin-key / FLEETGATE_ADMIN_KEY) is also tenant %r's API key: it "
            "opens no admin API, or that tenant would run the fleet. Give the admin a key of "
            "its own.",
            tenant.name,
        )


def is_admin(request: web.Request, admin_key: str | None, policy: GatewayPolicy) -> bool:
    """True if the request carries the admin key (``--admin-key`` or one of the policy's)."""
    key = bearer_key(request)
    if not key or key == MALFORMED_AUTHORIZATION:
        return False
    digest = sha256_hex(key)
    if digest in policy.tenants_by_key_sha256:
        # A tenant's key is never the admin key, even one given as --admin-key (the policy
        # file's admin hashes are checked against the tenants' when it is read; the flag's
        # value is not in the file): that tenant would run the fleet.
        return False
    if admin_key is not None and hmac.compare_digest(key.encode(), admin_key.encode()):
        return True
    return digest in policy.admin_key_sha256
