"""The gateway's aiohttp application factory: wiring, endpoints and lifecycle.

``create_app`` builds every collaborator (index, engine, tokenizer, registry, metrics), mounts the
OpenAI, health, metrics and admin endpoints, and owns the background tasks in one
``cleanup_ctx``: started after the pooled upstream session opens, cancelled and awaited before it
closes. The LoRA adapter registry needs that session, so it is built there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gateway import errors, health, openai_api
from gateway.adapters import AdapterSetup, learn_lora_disabled, open_registry, setup_from_policy
from gateway.admin import add_admin_routes, guard_where_configured
from gateway.apis.anthropic import error_response as anthropic_error_response
from gateway.apis.endpoints import add_api_routes
from gateway.auth import warn_if_admin_key_is_a_tenants
from gateway.background import run_in_background
from gateway.config import GatewayConfig
from gateway.cost import ReplicaTimeMeter, RouteWindow
from gateway.dashboard import add_dashboard_routes
from gateway.errors import GatewayError
from gateway.flow_control import build_flow_gate
from gateway.index_metrics import MirrorCollector
from gateway.inflight import InflightTracker, MemoryInflight, RedisInflight
from gateway.layout import LayoutDiagnostics
from gateway.logging_setup import HTTP_SERVER_LOG
from gateway.metrics import GatewayMetrics
from gateway.policy_view import GatewayPolicy, from_policy, policy_digest
from gateway.reload import file_identity
from gateway.replicas import ReplicaRegistry
from gateway.request_body import request_id_of, show_request_id
from gateway.response_affinity import build_response_affinity
from gateway.routing_glue import build_engine, build_gateway_index, build_prompt_tokenizer
from gateway.state import GATEWAY, GatewayState
from gateway.tasks import health_loop, inflight_loop, merge_fleet_store, policy_poll_loop
from gateway.tracing import build_tracer
from gateway.upstream_client import UpstreamPool
from routing.config import Policy
from routing.contracts import BlockIndex, IndexUnavailable, PromptTokenizer
from routing.index.mirror import MirrorBlockIndex
from routing.state import ReplicaState
from routing.types import ReplicaId

if TYPE_CHECKING:
    from replica.fleet_store import FleetStore

log = logging.getLogger(__name__)

#: How long startup waits for a mirrored index's bootstrap (it continues in the background).
INDEX_START_WAIT_S = 10.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_policy_view(config: GatewayConfig) -> GatewayPolicy:
    """The starting policy: the file's (``PolicyError`` if invalid), else policy-less defaults."""
    if config.policy_path is None:
        return GatewayPolicy.default(profile=config.default_profile)
    from routing.config import load_policy

    view = from_policy(load_policy(config.policy_path))
    config.apply_policy(view.source, startup=True)
    for warning in getattr(view.source, "warnings", list)():
        log.warning("policy %s: %s", config.policy_path, warning)
    return view


#: Paths whose errors go out in Anthropic's envelope (the Messages API and its sub-paths).
_ANTHROPIC_PATH = "/v1/messages"

#: Settings of aiohttp's per-connection request handler, on the app itself so that they hold
#: however the app is served (``start_site``, a test's or an embedder's runner).
HANDLER_ARGS: dict[str, Any] = {
    # Request bodies are decoded by ``request_body.read_body``, which counts the decoded bytes
    # against the body limit in bounded steps; aiohttp would decode a whole gzip bomb on the
    # event loop while discarding an unread body (docs/gateway.md, "Request bodies").
    "auto_decompress": False,
    # One header line may be 16 KiB (aiohttp: 8190 bytes): long JWTs and SSO cookies fit, and
    # reach the gateway's own 401 in the envelope instead of the parser's plain-text 400.
    "max_field_size": 16 * 1024,
    # Malformed requests are logged redacted, at DEBUG (no header bytes, no traceback).
    "logger": HTTP_SERVER_LOG,
}


def _error_response(request: web.Request, err: GatewayError) -> web.Response:
    """``err`` in the envelope of the API the path belongs to, with the request's id."""
    request_id = request_id_of(request)
    path = request.path
    if path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/"):
        return anthropic_error_response(err, request_id)
    return err.response(request_id)


@web.middleware
async def envelope_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths, wrong methods and unexpected failures still answer in the API's envelope
    (Anthropic's under ``/v1/messages``, else OpenAI's), with an ``X-Request-Id``."""
    try:
        return await handler(request)
    except GatewayError as err:
        return _error_response(request, err)
    except web.HTTPNotFound:
        err = GatewayError(404, errors.NOT_FOUND, f"No such endpoint: {request.path}")
        return _error_response(request, err)
    except web.HTTPMethodNotAllowed as exc:
        allow = ", ".join(sorted(exc.allowed_methods))
        err = GatewayError(
            405,
            errors.INVALID_REQUEST,
            f"Method {request.method} not allowed on {request.path}",
            headers={"Allow": allow},
        )
        return _error_response(request, err)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error on %s", request.path)
        err = GatewayError(500, errors.INTERNAL_ERROR, "Internal gateway error.")
        return _error_response(request, err)


def create_app(
    config: GatewayConfig,
    policy: GatewayPolicy | None = None,
    *,
    index: BlockIndex | None = None,
    tokenizer: PromptTokenizer | None = None,
    inflight: InflightTracker | None = None,
    fleet_store: FleetStore | None = None,
    adapters: AdapterSetup | None = None,
) -> web.Application:
    """Build a gateway application. Collaborators passed in are shared, not closed on exit.

    ``adapters``: the LoRA adapter registry's setup; by default the policy file's (policy mode),
    none without a policy file.
    """
    view = policy if policy is not None else load_policy_view(config)
    warn_if_admin_key_is_a_tenants(config.admin_key, view)
    if adapters is None:
        adapters = setup_from_policy(view.source, config)
    owns_fleet_store = fleet_store is None
    if fleet_store is None:
        fleet_store = _discovery_store(view.source)
    owns_index = index is None
    index = (
        index
        if index is not None
        else build_gateway_index(config.index_url, config.index_key_prefix, config.index_mode)
    )
    if inflight is None:
        inflight = (
            RedisInflight(config.redis_url, fleet=config.index_key_prefix)
            if config.redis_url
            else MemoryInflight()
        )
    registry = ReplicaRegistry(config.breaker_failures, config.breaker_cooldown_s)
    registry.set_static(view.replicas)
    registry.set_pool_speeds(view.pool_speeds)
    gw = GatewayState(
        config=config,
        policy=view,
        registry=registry,
        index=index,
        index_backend=(config.index_mode if config.index_mode == "mirror" else "redis")
        if config.redis_url
        else "memory",
        engine=build_engine(index, view, config.index_timeout_s),
        tokenizer=tokenizer
        or build_prompt_tokenizer(config.tokenizer_dir, config.remote_tokenizer_url, view),
        metrics=GatewayMetrics(),
        inflight=inflight,
        # Replica time is shared with the other gateways' requests there too.
        meter=ReplicaTimeMeter(others=inflight.others_in_flight)
        if isinstance(inflight, RedisInflight)
        else ReplicaTimeMeter(),
        tracer=build_tracer(config.otlp_endpoint),
        # One request in 16 past a route's first 200: the detector reads ~500 recent observations.
        layout=LayoutDiagnostics(sample_every=16, full_requests=200),
        window=RouteWindow(config.window_s),
        decisions=deque(maxlen=config.decision_log_size),
        max_retries=config.max_retries,
        fleet_store=fleet_store,
        # Shared through Redis when the gateway runs with Redis: a follow-up may reach any gateway.
        response_affinity=build_response_affinity(config.redis_url),
    )
    def fresh_states() -> Iterable[ReplicaState]:
        # With this gateway's in-flight counts as of now: an arrival admitted while another was
        # between its routing decision and its send (a budget check in Redis, steering) was
        # judged without it, and a burst of them overfilled the engines.
        registry.refresh_inflight(inflight)
        return registry.all()

    gw.flow = build_flow_gate(
        config.redis_url,
        config.index_key_prefix,
        gw.metrics,
        fresh_states,
        policy=lambda: gw.policy.source,
    )
    if isinstance(index, MirrorBlockIndex):  # reloads, rebuilds, readiness at /metrics
        gw.metrics.registry.register(MirrorCollector(index))
    # This process's own load (queued or upstream), read at each scrape: the HPA's metric.
    gw.metrics.gateway_inflight.set_function(lambda: gw.active_requests)
    # A replica that leaves takes its gauges along (a frozen healthy=1 would outlive it).
    registry.on_remove.append(gw.metrics.forget_replica)
    if config.policy_path is not None:
        with contextlib.suppress(OSError):
            gw.policy_file_seen = file_identity(config.policy_path)
    gw.metrics.set_policy(policy_digest(gw.policy.source), gw.policy.routes)

    app = web.Application(middlewares=[envelope_errors], handler_args=HANDLER_ARGS)
    app[GATEWAY] = gw
    app.on_response_prepare.append(show_request_id)
    app.on_response_prepare.append(health.close_connections_when_stopping)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_get("/v1/models", openai_api.list_models)
    app.router.add_get("/v1/models/{model:.+}", openai_api.retrieve_model)
    add_api_routes(app)  # Responses, Anthropic Messages, embeddings, tokenize (gateway/apis/)
    app.router.add_get("/health", health.health)
    for method in ("GET", "POST"):  # vLLM's (SageMaker's) liveness path: the gateway's own
        app.router.add_route(method, "/ping", health.health)
    app.router.add_get("/ready", health.ready)
    app.router.add_get("/metrics", health.metrics)
    add_admin_routes(app)
    add_dashboard_routes(app, guard_where_configured)
    app.cleanup_ctx.append(
        _lifecycle(
            owns_index,
            owns_tokenizer=tokenizer is None,
            owns_fleet=owns_fleet_store,
            adapters=adapters,
        )
    )
    app.on_shutdown.append(_start_draining)
    return app


def _discovery_store(policy: Policy | None) -> FleetStore | None:
    """The fleet store of the first pool with ``discovery`` (agents register replicas there)."""
    for pool in getattr(policy, "replica_pools", None) or ():
        if pool.discovery is not None:
            from replica.fleet_store import RedisFleetStore

            return RedisFleetStore(pool.discovery.redis_url, key_prefix=pool.discovery.key_prefix)
    return None


def _lifecycle(
    owns_index: bool, owns_tokenizer: bool, owns_fleet: bool, adapters: AdapterSetup | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        gw = app[GATEWAY]
        # limit=0: the gateway's concurrency is bounded by clients, not by a pool size.
        gw.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
        )
        gw.upstream = UpstreamPool(connect_timeout_s=gw.config.connect_timeout_s)
        gw.metrics.upstream_connections.set_function(
            lambda: gw.upstream.open_connections if gw.upstream is not None else 0
        )
        # A mirrored index bootstraps before serving, for at most INDEX_START_WAIT_S: past it
        # (Redis down, a very large index) the gateway serves load-only until the mirror is
        # ready, which fleetgate_index_mirror_ready shows.
        start_index = getattr(gw.index, "start", None)
        if owns_index and start_index is not None:
            try:
                async with asyncio.timeout(INDEX_START_WAIT_S):
                    await start_index()
            except (IndexUnavailable, TimeoutError) as exc:
                why = str(exc) or type(exc).__name__
                log.warning("block index not ready at startup (%s); routing on load alone", why)
        # One poll before serving, so /ready and routing know the replicas from the start.
        if gw.fleet_store is not None:
            await merge_fleet_store(gw)
        with contextlib.suppress(Exception):
            await gw.registry.poll_once(gw.session, timeout_s=2.0)
        if adapters is not None:
            gw.adapters = open_registry(gw, adapters)
            gw.registry.on_remove.append(functools.partial(_forget_adapters_of, gw))
            # The engines' adapter lists before the first request; the loop keeps them fresh.
            await gw.adapters.refresh(gw.registry.adapter_states())
        tasks = [
            asyncio.create_task(health_loop(gw), name="fleetgate-health"),
            asyncio.create_task(inflight_loop(gw), name="fleetgate-inflight"),
        ]
        if gw.flow is not None:
            tasks.append(asyncio.create_task(gw.flow.run(), name="fleetgate-flow-control"))
        if gw.adapters is not None and adapters is not None:
            tasks.append(
                asyncio.create_task(
                    gw.adapters.run(
                        gw.registry.adapter_states,
                        refresh_interval_s=gw.config.health_interval_s,
                        prewarm_interval_s=adapters.prewarm_interval_s,
                        on_prewarm=lambda report: learn_lora_disabled(gw.registry, report),
                    ),
                    name="fleetgate-adapters",
                )
            )
        if gw.config.policy_path and gw.config.policy_poll_s > 0:
            tasks.append(asyncio.create_task(policy_poll_loop(gw), name="fleetgate-policy-poll"))
        try:
            yield
        finally:
            await _clean_up(gw, tasks, owns_index, owns_tokenizer, owns_fleet)

    return lifecycle


async def _clean_up(
    gw: GatewayState,
    tasks: list[asyncio.Task[Any]],
    owns_index: bool,
    owns_tokenizer: bool,
    owns_fleet: bool,
) -> None:
    """Stop the background tasks and close every connection, within ``cleanup_timeout_s``.

    Each step gets what is left of the budget; one that overruns (a task that does not end when
    cancelled, a close waiting on a hung Redis) is abandoned with a warning naming it, so the
    next steps still run and the process still exits.
    """
    deadline = asyncio.get_running_loop().time() + gw.config.cleanup_timeout_s
    running = [*tasks, *gw.background]
    for task in running:
        task.cancel()
    if running:
        # asyncio.wait, not gather: a cancelled gather still waits for every child to end.
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        _done, stuck = await asyncio.wait(running, timeout=remaining)
        if stuck:
            names = ", ".join(sorted(t.get_name() for t in stuck))
            log.warning(
                "shutdown: background tasks did not finish within the clean-up budget; "
                "abandoned: %s",
                names,
            )
    if gw.adapters is not None:  # cancels loads in progress, before the session closes
        await _within(deadline, "adapter registry", gw.adapters.close())
        gw.adapters = None
    if gw.session is not None:
        await _within(deadline, "health-poll session", gw.session.close())
        gw.session = None
    if gw.upstream is not None:
        await _within(deadline, "upstream connections", gw.upstream.close())
        gw.upstream = None
    await _within(deadline, "in-flight counts", gw.inflight.close())
    await _within(deadline, "response affinity", gw.response_affinity.close())
    close_tokenizer = getattr(gw.tokenizer, "close", None)
    if owns_tokenizer and close_tokenizer is not None:
        await _within(deadline, "tokenizer", close_tokenizer())
    if owns_index:
        await _within(deadline, "block index", gw.index.close())
    if owns_fleet and gw.fleet_store is not None:
        await _within(deadline, "fleet store", gw.fleet_store.close())


async def _within(deadline: float, what: str, step: Awaitable[Any]) -> None:
    """Await ``step`` until ``deadline`` (loop time); past it, give up on it and say so."""
    remaining = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        async with asyncio.timeout(remaining):
            await step
    except TimeoutError:
        log.warning("shutdown: %s did not finish within the clean-up budget; abandoned", what)
    except Exception:  # a close that fails must not stop the ones after it
        log.exception("shutdown: closing %s failed", what)


async def _start_draining(app: web.Application) -> None:
    """Refuse new requests (``stop_serving`` already does, from its drain on)."""
    app[GATEWAY].draining = True


def _forget_adapters_of(gw: GatewayState, replica: ReplicaId) -> None:
    """A replica left the fleet: the adapter registry drops its placement and slot gauges (a
    tracked background task; a later replica reusing the id starts clean)."""
    if gw.adapters is None:
        return
    forget = gw.adapters.forget_replica(replica)
    run_in_background(gw.background, forget, "fleetgate-adapter-forget")
