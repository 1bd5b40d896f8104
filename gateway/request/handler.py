"""The completion handler: one request through route → forward → account, top to bottom."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from gateway import errors
from gateway.auth import still_authorised
from gateway.errors import GatewayError
from gateway.flow_control import engine_priority, flow_finished, flow_not_sent
from gateway.proxy import UpstreamOutcome
from gateway.request.account import (
    account,
    completion_tokens_of,
    count_failed_before_forwarding,
    record_refusal,
)
from gateway.request.forward import AttemptRecorder, forward, plan_forward, with_client_salt
from gateway.request.kinds import RequestKind
from gateway.request.route import (
    RequestLabels,
    RouteDecision,
    admit,
    count_sent,
    repick,
    route,
)
from gateway.request_body import (
    SHOWN_REQUEST_ID,
    caller_scope,
    read_body,
    request_id_of,
    unique_id,
)
from gateway.state import GATEWAY, GatewayState
from gateway.tracing import client_context, request_span


def usage_to_charge(outcome: UpstreamOutcome) -> Mapping[str, Any] | None:
    """The usage the tenant's token budget is charged: the engine's, or, for a stream that ended
    before its usage chunk (it comes after the last token: the client left, or the replica
    failed or stalled mid-stream), at least the tokens relayed (one per output event), so that
    hanging up early never makes an answer free and a broken stream is charged what it
    delivered."""
    if outcome.usage is not None or outcome.ttft_s is None:
        return outcome.usage
    return {"completion_tokens": max(1, outcome.output_events)}


def settle(
    gw: GatewayState,
    kind: RequestKind,
    routed: RouteDecision,
    outcome: UpstreamOutcome,
    arrived: float,
    streamed: bool,
    usage: Mapping[str, Any] | None,
    answering: bool = False,
) -> None:
    """Charge the tenant's budget for a finished request and account for it (``answering``:
    the handler is about to return, so the accounting runs after the answer is written)."""
    if kind.usage is not None:  # the API's own usage shape, as accounting reads it
        usage = kind.usage(usage)
    outcome.usage = usage
    if not answering:
        outcome.finished_at = time.monotonic()
    flow_finished(
        gw,
        gw.policy.source,
        routed.tenant.name,
        usage_to_charge(outcome),
        routed.routing_request.request_id,
        outcome.tpot_ms(
            completion_tokens_of(outcome.usage), routed.routing_request.choices
        ),
        # The prompt tokens reserved for it, settled against the engine's count.
        reserved=routed.budget_reserved,
    )
    if answering:
        asyncio.get_running_loop().call_soon(account, gw, routed, outcome, arrived, streamed)
    else:
        account(gw, routed, outcome, arrived, streamed)


async def handle(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    """``POST`` of one OpenAI request of ``kind`` (``/v1/chat/completions``, ...)."""
    gw = request.app[GATEWAY]
    asked = request_id_of(request)
    request_id = unique_id(asked, gw.request_ids)
    gw.request_ids.add(request_id)
    # Only a client's own id can collide with another caller's: a generated one is unique, and
    # the credential digest is not worth computing for it.
    own_id = None
    if asked == request.headers.get("X-Request-Id"):
        own_id = (caller_scope(request), asked)
        if request_id != asked and not gw.asked_ids[own_id]:
            request[SHOWN_REQUEST_ID] = asked  # another caller's id in flight: not for this one
        gw.asked_ids[own_id] += 1
    arrived = time.monotonic()
    labels = RequestLabels()
    forwarded = False
    stream = False
    routed: RouteDecision | None = None
    gw.active_requests += 1
    try:
        parent = client_context(gw.tracer, request.headers)  # the client's traceparent
        with request_span(gw.tracer, "fleetgate.request", parent) as span:
            span.set_attribute("fleetgate.kind", kind.name)
            if gw.draining:
                raise errors.shutting_down()
            tenant = admit(request, gw.policy, gw.rate_limiter)
            body, raw = await read_body(
                request, gw.config.max_body_bytes, gw.config.body_timeout_s
            )
            kind.validate(body)
            tenant = with_client_salt(tenant, body, gw.policy.open_access)
            stream = kind.streams and isinstance(body, Mapping) and body.get("stream") is True
            if kind.prepare is not None:
                body = kind.prepare(body)
            # ADMISSION: an admission step (queueing, concurrency limits) is awaited here, with
            # the tenant and the checked body known and nothing routed yet.
            pinned = None
            if kind.pinned_replica is not None:  # e.g. where a previous response is stored
                pinned = await kind.pinned_replica(gw, tenant, body)
            routed = await route(gw, request, tenant, kind, body, request_id, labels, pinned=pinned)
            span.set_attribute("fleetgate.route", routed.route.name)
            if gw.flow is not None:
                admitted_under = gw.policy
                if pinned is None:
                    # Flow control judges by the routing estimate, so it runs on the decision:
                    # a queued request is routed again when its turn comes (flow-control.md).
                    routed = await gw.flow.admit(
                        routed,
                        request.headers,
                        gw.policy.source,
                        lambda r, only=None: repick(gw, r, only),
                    )
                else:  # one replica can serve it: only its budget is checked
                    routed = await gw.flow.admit_pinned(routed, request.headers, gw.policy.source)
                if gw.policy is not admitted_under:
                    # Reloaded while it queued: a key revoked (or moved to another tenant)
                    # meanwhile is refused here as it is for a new request (the reload review:
                    # a revoked tenant's queued requests were served with its salt).
                    still_authorised(request, gw.policy, tenant)
            priority = engine_priority(routed, request.headers, gw.policy.source)
            if "priority" in body and priority.value is None and not priority.client_may_set:
                gw.metrics.flow_priority_field_dropped.labels(tenant.name).inc()
            plan = plan_forward(
                routed,
                kind,
                body,
                raw,
                max_retries=gw.max_retries,
                read_timeout_s=gw.config.upstream_timeout_s,
                client_stall_s=gw.config.client_stall_timeout_s,
                priority=priority,
            )
            recorder = AttemptRecorder(gw, routed, arrived)
            if gw.flow is not None:
                flow = gw.flow
                recorder.on_started = lambda: flow.forwarding(request_id)
            forwarded = True  # from here on, accounting records the request
            count_sent(gw.metrics, routed)
            if kind.served_by is not None:
                served_by = kind.served_by
                # Told which replica answers before its first byte can reach the client, so a
                # follow-up sent the moment the answer ends finds it (a fallback's included).
                recorder.on_answer = lambda replica: served_by(gw, tenant, body, replica)
            answer: web.StreamResponse | None = None
            try:
                answer = await forward(gw, request, routed, plan, recorder)
                return answer
            finally:
                outcome = recorder.outcome
                later = kind.finishes_later(body, outcome, answer) if kind.finishes_later else None
                if later is not None and outcome.replica is not None:
                    # A background response: accounted with its usage once it ends.
                    def ended(usage: Mapping[str, Any] | None, status: str | None) -> None:
                        if status is not None:
                            # The engine finished it (the client may fetch it later): not
                            # abandoned, whether or not the client left the stream.
                            outcome.client_gone = False
                        if status == "failed":  # the engine failed it: an upstream error
                            outcome.status = 502
                        outcome.settled_later = True
                        settle(gw, kind, routed, outcome, arrived, False, usage)

                    gw.background_responses.watch(later, outcome.replica, ended)
                else:
                    # After the handler returns, aiohttp writes the response before the loop
                    # runs the accounting: it stays off the client's latency.
                    settle(gw, kind, routed, outcome, arrived, plan.stream, outcome.usage, True)
    except asyncio.CancelledError:
        if not forwarded and routed is not None:
            # The client left while its request waited to be sent (flow control's queue): a
            # 499 like a client that leaves mid-answer, so the request totals add up.
            gw.metrics.requests.labels(labels.route, labels.model, "none", "499").inc()
        raise
    except GatewayError as err:
        gw.metrics.errors.labels(labels.route, err.code).inc()
        if not forwarded:
            status = str(err.status)
            gw.metrics.requests.labels(labels.route, labels.model, "none", status).inc()
            _count_slo_failure(gw, labels, err, stream)
            if routed is not None:
                record_refusal(gw, routed, err.status, err.code)
        if kind.error_response is not None:
            return kind.error_response(err, request_id)
        return err.response(request_id)
    finally:
        gw.active_requests -= 1
        gw.request_ids.discard(request_id)
        if own_id is not None:
            gw.asked_ids[own_id] -= 1
            if not gw.asked_ids[own_id]:
                del gw.asked_ids[own_id]
        if gw.flow is not None:  # released from the queue but never sent: the pump goes on
            gw.flow.forwarding(request_id)
            if not forwarded and routed is not None:
                # Admitted (its prompt tokens reserved), then refused or left before it was
                # sent: a 401 for a key a reload revoked while it queued, a client gone.
                flow_not_sent(gw, gw.policy.source, routed)


def _count_slo_failure(
    gw: GatewayState, labels: RequestLabels, err: GatewayError, stream: bool
) -> None:
    """A routed request the gateway failed before forwarding it counts against the route's
    SLOs (goodput); client errors (4xx) do not, nor does a gateway going down (retry at once)."""
    if err.status < 500 or err.code == errors.SHUTTING_DOWN:
        return
    route = next((r for r in gw.policy.routes if r.name == labels.route), None)
    if route is not None:
        count_failed_before_forwarding(gw.metrics, route, stream)
