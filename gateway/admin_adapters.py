"""Admin endpoints of the LoRA adapter registry (mounted, behind the admin key, by ``admin.py``).

- ``GET /admin/adapters``: the catalog (file and runtime entries) and where each adapter is loaded;
- ``POST /admin/adapters``: add a runtime adapter (``?replace=true`` updates one);
- ``DELETE /admin/adapters/{name}``: remove a runtime adapter and unload it everywhere.

Runtime additions live in this gateway process only: with several gateways, send the call to
each (or put the adapter in the policy file, which every gateway reads).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from adapters_registry import AdapterNotFound, AdapterRegistry, InvalidAdapter
from gateway import errors
from gateway.errors import GatewayError
from gateway.request_body import read_json
from gateway.state import GATEWAY, GatewayState

#: An aiohttp handler, as ``admin.py``'s guard takes and returns it (spelled out here: importing
#: it from ``admin.py``, which mounts these routes, would make the two files a cycle).
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _registry(gw: GatewayState) -> AdapterRegistry:
    if gw.adapters is None:
        raise GatewayError(
            409,
            errors.ADAPTERS_DISABLED,
            "The adapter registry is off: run with a policy file (or `fleetgate up --adapters N`).",
        )
    return gw.adapters


def _invalid(exc: InvalidAdapter, status: int = 400) -> web.Response:
    error = GatewayError(status, errors.INVALID_ADAPTER, str(exc))
    body: dict[str, Any] = error.envelope()
    body["error"]["details"] = list(exc.errors)
    return web.json_response(body, status=status)


async def list_adapters(request: web.Request) -> web.Response:
    """The catalog, and per replica what is resident, on which tier, with requests in flight."""
    gw = request.app[GATEWAY]
    try:
        registry = _registry(gw)
    except GatewayError as err:
        return err.response()
    states = gw.registry.adapter_states()
    # The engines' latest reports, not the last loop's; a read unloads nothing.
    await registry.refresh(states, trim=False)
    replicas = []
    where: dict[str, list[str]] = {}
    for state in states:
        placement = registry.view.get(state.replica_id)
        capacity = registry.capacity(state)
        resident = sorted(placement.resident) if placement is not None else []
        for name in resident:
            where.setdefault(name, []).append(state.replica_id)
        replicas.append(
            {
                "replica": state.replica_id,
                "healthy": state.healthy,
                "max_loras": capacity.gpu,
                "max_cpu_loras": capacity.host,
                "resident": {name: placement.tier(name, capacity.gpu) for name in resident}
                if placement is not None
                else {},
                "inflight": dict(placement.inflight) if placement is not None else {},
                "recent_loads": len(placement.recent_loads) if placement is not None else 0,
                "adapters_read_at": gw.registry.adapters_read_at(state.replica_id),
            }
        )
    catalog = [
        {
            **adapter.model_dump(mode="json"),
            "runtime": registry.catalog.is_runtime(adapter.name),
            "loaded_on": sorted(where.get(adapter.name, [])),
            # Its ``adapter`` label on /metrics (opaque for a private adapter).
            "metrics_label": registry.catalog.metrics_label(adapter.name),
        }
        for adapter in registry.catalog
    ]
    return web.json_response(
        {"store": registry.store.backend, "adapters": catalog, "replicas": replicas}
    )


async def add_adapter(request: web.Request) -> web.Response:
    """``POST /admin/adapters`` with a catalog entry (the policy file's ``adapters:`` schema)."""
    gw = request.app[GATEWAY]
    try:
        registry = _registry(gw)
        # The request body reader: compressed, oversized, invalid, non-object and too deeply
        # nested bodies get the same answers as on the API.
        spec = await read_json(request, gw.config.max_body_bytes, gw.config.body_timeout_s)
    except GatewayError as err:
        return err.response()
    replace = request.query.get("replace", "").lower() in ("1", "true", "yes")
    before = registry.catalog.find(str(spec.get("name", ""))) if replace else None
    try:
        adapter = registry.add(spec, replace=replace)
    except InvalidAdapter as exc:
        return _invalid(exc)
    failures: list[str] = []
    if registry.weights_changed(adapter.name, before):
        # New weights under an old name: the replicas still holding the old ones drop them
        # before this answers, so the next request loads the new source.
        failures = await registry.unload_everywhere(
            adapter.name, gw.registry.adapter_states(), reason="replaced", only_replaced=True
        )
    return web.json_response(
        {"added": adapter.model_dump(mode="json"), "unload_failures": failures}, status=201
    )


async def remove_adapter(request: web.Request) -> web.Response:
    """``DELETE /admin/adapters/{name}``: out of the catalog, then unloaded from every replica."""
    gw = request.app[GATEWAY]
    name = request.match_info["name"]
    try:
        registry = _registry(gw)
    except GatewayError as err:
        return err.response()
    try:
        failures = await registry.remove(name, gw.registry.adapter_states())
    except AdapterNotFound:
        return GatewayError(404, errors.NOT_FOUND, f"No runtime adapter named `{name}`.").response()
    except InvalidAdapter as exc:  # defined in the policy file: edit the file instead
        return _invalid(exc, status=409)
    return web.json_response({"removed": name, "unload_failures": failures})


def add_adapter_routes(app: web.Application, guard: Callable[[Handler], Handler]) -> None:
    """Mount the endpoints, each wrapped in ``guard`` (the admin-key check)."""
    app.router.add_get("/admin/adapters", guard(list_adapters))
    app.router.add_post("/admin/adapters", guard(add_adapter))
    app.router.add_delete("/admin/adapters/{name}", guard(remove_adapter))
