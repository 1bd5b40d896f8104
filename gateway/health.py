"""``/health`` (the process answers), ``/ready`` (this gateway can serve), ``/metrics``."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import errors
from gateway.errors import GatewayError
from gateway.policy_view import Route
from gateway.state import GATEWAY, GatewayState


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves HTTP."""
    return web.json_response({"status": "ok"})


def configured_models(gw: GatewayState) -> set[str]:
    """Models the gateway must be able to serve: the policy's, else what replicas report."""
    return set(gw.policy.known_models) or gw.registry.base_models()


async def ready(request: web.Request) -> web.Response:
    """Readiness of this gateway, for a load balancer: 200 while it can serve (started, its
    policy loaded, not draining or stopping), whatever the replicas' health.

    ``models`` says, per configured model, whether a healthy replica serves it now (for people
    and scripts: ``all_models_ready``). It does not decide readiness: one model's pool being down
    must not take every gateway, and with them the healthy models, out of the Service; a request
    for the model without a replica gets its own 503 (``no_healthy_replica``), which
    FleetgateNoHealthyReplica alerts on.
    """
    gw = request.app[GATEWAY]
    serving = gw.registry.ready_models()
    models = {m: serving.get(m, False) for m in configured_models(gw)}
    stopping = gw.draining or gw.stopping
    is_ready = not stopping
    return web.json_response(
        {
            "ready": is_ready,
            "draining": stopping,
            "all_models_ready": bool(models) and all(models.values()),
            "models": models,
        },
        status=200 if is_ready else 503,
    )


def refresh_gauges(gw: GatewayState) -> None:
    """Recompute window gauges (hit rate, cost, layout, replica health) just before a scrape."""
    m = gw.metrics
    # At each scrape, not once at start: a policy reload may add routes.
    routes = [(r.name, _slos(r)) for r in gw.policy.routes]
    pools: dict[str, int] = {}  # pool -> replicas
    for state in gw.registry.all():
        pools[state.pool] = pools.get(state.pool, 0) + 1
    m.precreate(routes, configured_models(gw), gw.index_backend, pools)
    for route, rate in gw.window.hit_rates().items():
        m.prefix_hit_rate.labels(route).set(rate)
    for route, usd in gw.window.cost_per_1m(gw.policy.pool_usd_per_hour, pools).items():
        m.cost_per_1m.labels(route).set(usd)
    m.pool_bill.clear()  # a pool gone, or its price, takes its series along
    for pool, replicas in pools.items():
        price = gw.policy.pool_usd_per_hour.get(pool)
        if price is not None:
            m.pool_bill.labels(pool).set(price * replicas)
    for report in gw.layout.reports():
        m.prefix_repeat_fraction.labels(report.route).set(report.prefix_repeat_fraction)
        m.cache_busting_layout.labels(report.route).set(1 if report.cache_busting_layout else 0)
    counts = gw.inflight.counts()
    for state in gw.registry.routable():
        m.replica_healthy.labels(state.replica_id).set(1 if state.healthy else 0)
        m.replica_inflight.labels(state.replica_id).set(counts.get(state.replica_id, (0, 0))[0])
        if state.decode_itl_ms is not None:
            m.replica_decode_itl.labels(state.replica_id).set(state.decode_itl_ms / 1000.0)
        else:  # idle, or an engine that does not export it: no sample rather than a stale one
            m.replica_decode_itl.remove(state.replica_id)


def _slos(route: Route) -> list[str]:
    """The SLOs accounting checks ``route`` against (``fleetgate_slo_requests_total{slo}``)."""
    declared = {"ttft": route.ttft_slo_ms, "tpot": route.tpot_slo_ms}
    return [slo for slo, target in declared.items() if target is not None]


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition of this gateway's registry."""
    gw = request.app[GATEWAY]
    if not gw.config.metrics_enabled:
        raise GatewayError(
            404,
            errors.NOT_FOUND,
            "Metrics are off in this gateway (fleetgate serve --workers N --no-metrics): each "
            "worker process would answer with its own counters. Run one worker per pod and "
            "scale pods to have /metrics (docs/gateway.md).",
        )
    refresh_gauges(gw)
    body = generate_latest(gw.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def close_connections_when_stopping(
    request: web.Request, response: web.StreamResponse
) -> None:
    """``on_response_prepare``: once the gateway is stopping, every answer closes its connection
    (``Connection: close``). A client kept its keep-alive connection through the stop delay and
    could send its next request just as the drain closed it: the request was lost to "server
    disconnected" instead of reaching a gateway still in rotation (the replay review)."""
    gw = request.app[GATEWAY]
    if gw.stopping or gw.draining:
        response.force_close()
        # The hook runs after aiohttp chose the Connection header: said here, or the client
        # would not know and reuse a connection the gateway then closes.
        response.headers["Connection"] = "close"
