"""The admin API under ``/admin/``, behind a separate admin key.

Replicas and their state, the active policy, reload, index stats, recent routing decisions with
their explanations, the prefix-layout report, and the LoRA adapters (``admin_adapters.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway import errors
from gateway.admin_adapters import add_adapter_routes
from gateway.auth import bearer_key, is_admin
from gateway.errors import GatewayError
from gateway.policy_view import policy_digest
from gateway.reload import reload_policy
from gateway.state import GATEWAY
from routing.redis_clients import redacted

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=_default, indent=1)


def _default(obj: Any) -> Any:
    if isinstance(obj, frozenset | set):
        return sorted(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)


def _guard(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        gw = request.app[GATEWAY]
        if gw.config.admin_key is None and not gw.policy.admin_key_sha256:
            return GatewayError(
                403, errors.ADMIN_DISABLED, "The admin API is disabled: configure an admin key."
            ).response()
        if not is_admin(request, gw.config.admin_key, gw.policy):
            sent = bool(bearer_key(request))
            message = (
                "Incorrect admin key."
                if sent
                else "An admin key is required: send it as 'Authorization: Bearer <admin key>'."
            )
            return GatewayError(401, errors.INVALID_API_KEY, message).response()
        return await handler(request)

    return guarded


def guard_where_configured(handler: Handler) -> Handler:
    """The admin key's guard where one is configured or tenants are declared; open otherwise
    (the dashboard's data).

    The dashboard shows what ``/metrics`` (open) shows, plus replica ids and recent decisions
    (with each decision's adapter): a gateway without an admin key and without tenants, like a
    policy-less quick start, still gets a dashboard. With tenants it would show every caller the
    names of other tenants' private adapters, which the API takes care never to reveal, so it
    answers as ``/admin/*`` does: 403 until an admin key is configured.
    """
    guarded_handler = _guard(handler)

    async def guarded(request: web.Request) -> web.StreamResponse:
        gw = request.app[GATEWAY]
        no_admin_key = gw.config.admin_key is None and not gw.policy.admin_key_sha256
        if no_admin_key and gw.policy.open_access:
            return await handler(request)
        return await guarded_handler(request)

    return guarded


async def replicas(request: web.Request) -> web.Response:
    """Every known replica: state as policies see it, circuit breaker, in-flight counts."""
    gw = request.app[GATEWAY]
    gw.registry.set_inflight(
        gw.inflight.counts(), gw.inflight.ended_since, gw.inflight.awaiting_prefill
    )
    out = []
    for state in gw.registry.all():
        item = dataclasses.asdict(state)
        item["url"] = redacted(state.url)  # a password in it (basic auth to a proxy) never shown
        item["circuit"] = gw.registry.breaker(state.replica_id).state.value
        item["staleness_s"] = state.shown_staleness_s()
        # ``prefill_tokens_per_s`` is the pool's configured figure; what routing believes
        # after calibration, per profile that learns it, is this.
        learned = gw.engine.calibrated_speeds(state.replica_id)
        item["calibrated_prefill_tokens_per_s"] = {n: round(v) for n, v in learned.items()}
        out.append(item)
    return _json({"replicas": out})


async def policy(request: web.Request) -> web.Response:
    """The active policy (routes, tenants without keys, adapters, pools) and the last refusal."""
    gw = request.app[GATEWAY]
    view = gw.policy
    source = view.source
    return _json(
        {
            "path": gw.config.policy_path,
            # Compare across pods: a reload reaches each pod on its own (SIGHUP, its file poll,
            # or this API through a Service, which reaches one pod).
            "digest": policy_digest(source),
            "summary": source.summary() if hasattr(source, "summary") else "policy-less defaults",
            "routes": [
                {"name": r.name, "profile": r.profile, "ttft_slo_ms": r.ttft_slo_ms}
                for r in view.routes
            ],
            "tenants": sorted(view.tenants_by_name),
            "open_access": view.open_access,
            "adapters": [dataclasses.asdict(a) for a in view.adapters.values()],
            "pool_usd_per_hour": dict(view.pool_usd_per_hour),
            "last_reload_errors": gw.policy_errors,
            # The summary is the file's; these of its settings are not in force until a restart.
            "restart_needed": gw.restart_needed,
        }
    )


async def reload(request: web.Request) -> web.Response:
    """``POST /admin/policy/reload``: 200 with a summary, or 400 with every error (409 on a
    gateway started without a policy file: there is nothing to reload)."""
    gw = request.app[GATEWAY]
    if gw.config.policy_path is None:
        error = GatewayError(
            409, errors.NO_POLICY_FILE,
            "This gateway runs without a policy file (started without --config): there is "
            "nothing to reload. Start it with --config POLICY.yaml to reload policies live.",
        )
        return _json(error.envelope(), status=409)
    result = reload_policy(gw)
    if result.ok:
        body = {"reloaded": True, "summary": result.summary}
        if result.restart_needed:
            body["restart_needed"] = result.restart_needed
        return _json(body)
    error = GatewayError(400, errors.POLICY_INVALID, "Policy refused; the running policy stays.")
    body = error.envelope()
    body["error"]["details"] = result.errors  # type: ignore[assignment]
    return _json(body, status=400)


async def index_stats(request: web.Request) -> web.Response:
    """Block index size and health, and which Redis holds it (password hidden)."""
    gw = request.app[GATEWAY]
    url = gw.config.index_url
    where = {"redis_url": redacted(url)} if url and url != "memory" else {}
    try:
        stats = await gw.index.stats()
    except Exception as exc:  # Redis down: report it rather than fail the admin call
        return _json(
            {"backend": gw.index_backend, "available": False, "error": str(exc), **where}
        )
    # A mirror answers stats from its copy while Redis is away, but lookups are refused then
    # (load-only routing): it is available to routing only while ready and connected.
    extra = stats.extra or {}
    available = bool(extra.get("ready", True)) and bool(extra.get("connected", True))
    return _json({"available": available, **dataclasses.asdict(stats), **where})


async def decisions(request: web.Request) -> web.Response:
    """The last N routing decisions (``?n=``), newest first, with explanations."""
    gw = request.app[GATEWAY]
    try:
        n = max(1, min(int(request.query.get("n", "20")), len(gw.decisions) or 1))
    except ValueError:
        error = GatewayError(
            400, errors.INVALID_REQUEST,
            f"`n` must be a whole number of decisions (got {request.query['n']!r}).", "n",
        )
        return _json(error.envelope(), status=400)
    # Explanations are materialised only here, on read (``DecisionRecord.as_json``).
    recent = [record.as_json() for record in list(gw.decisions)[-n:][::-1]]
    return _json({"decisions": recent})


async def layout(request: web.Request) -> web.Response:
    """Prefix-layout report per route: repeat fraction, cache-busting detection, advice."""
    gw = request.app[GATEWAY]
    return _json({"routes": [dataclasses.asdict(r) for r in gw.layout.reports()]})


def add_admin_routes(app: web.Application) -> None:
    """Mount the admin endpoints."""
    app.router.add_get("/admin/replicas", _guard(replicas))
    app.router.add_get("/admin/policy", _guard(policy))
    app.router.add_post("/admin/policy/reload", _guard(reload))
    app.router.add_get("/admin/index", _guard(index_stats))
    app.router.add_get("/admin/decisions", _guard(decisions))
    app.router.add_get("/admin/layout", _guard(layout))
    add_adapter_routes(app, _guard)
