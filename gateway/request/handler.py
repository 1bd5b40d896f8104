"""The completion handler: one request through route → forward → account, top to bottom."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gateway import errors
from gateway.errors import GatewayError
from gateway.flow_control import flow_finished
from gateway.request.account import account, completion_tokens_of
from gateway.request.forward import AttemptRecorder, forward, plan_forward
from gateway.request.kinds import RequestKind
from gateway.request.route import RequestLabels, admit, repick, route
from gateway.request_body import read_body, request_id_of, unique_id
from gateway.state import GATEWAY


async def handle(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    """``POST`` of one OpenAI request of ``kind`` (``/v1/chat/completions``, ...)."""
    gw = request.app[GATEWAY]
    request_id = unique_id(request_id_of(request), gw.request_ids)
    gw.request_ids.add(request_id)
    arrived = time.monotonic()
    labels = RequestLabels()
    forwarded = False
    gw.active_requests += 1
    try:
        with gw.tracer.start_as_current_span("fleetgate.request") as span:
            span.set_attribute("fleetgate.kind", kind.name)
            if gw.draining:
                raise GatewayError(503, errors.SHUTTING_DOWN, "The gateway is shutting down.")
            tenant = admit(request, gw.policy, gw.rate_limiter)
            body, raw = await read_body(request, gw.config.max_body_bytes)
            kind.validate(body)
            if kind.prepare is not None:
                body = kind.prepare(body)
            # ADMISSION: an admission step (queueing, concurrency limits) is awaited here, with
            # the tenant and the checked body known and nothing routed yet.
            pinned = None
            if kind.pinned_replica is not None:  # e.g. where a previous response is stored
                pinned = await kind.pinned_replica(gw, tenant, body)
            routed = await route(gw, request, tenant, kind, body, request_id, labels, pinned=pinned)
            span.set_attribute("fleetgate.route", routed.route.name)
            if gw.flow is not None and pinned is None:
                # Flow control judges by the routing estimate, so it runs on the decision: a
                # queued request is routed again when its turn comes (docs/flow-control.md).
                routed = await gw.flow.admit(
                    routed,
                    request.headers,
                    gw.policy.source,
                    lambda r, only=None: repick(gw, r, only),
                )
            elif gw.flow is not None:  # one replica can serve it: only its budget is checked
                routed = await gw.flow.admit_pinned(routed, request.headers, gw.policy.source)
            plan = plan_forward(
                routed,
                kind,
                body,
                raw,
                max_retries=gw.max_retries,
                read_timeout_s=gw.config.upstream_timeout_s,
                priority=gw.flow.engine_priority(routed, request.headers, gw.policy.source)
                if gw.flow is not None
                else None,
            )
            recorder = AttemptRecorder(gw, routed, arrived)
            forwarded = True  # from here on, accounting records the request
            if kind.served_by is not None:  # told before the first byte can reach the client
                await kind.served_by(gw, tenant, body, routed.decision.replica)
            try:
                response = await forward(gw, request, routed, plan, recorder)
                served = recorder.outcome.replica
                if kind.served_by is not None and served not in (None, routed.decision.replica):
                    await kind.served_by(gw, tenant, body, served)  # a fallback answered
                return response
            finally:
                if kind.usage is not None:  # the API's own usage shape, as accounting reads it
                    recorder.outcome.usage = kind.usage(recorder.outcome.usage)
                outcome = recorder.outcome
                flow_finished(
                    gw,
                    gw.policy.source,
                    routed.tenant.name,
                    outcome.usage,
                    request_id,
                    outcome.tpot_ms(completion_tokens_of(outcome.usage)),
                    # Not tokenized here (embeddings, a stored conversation's follow-up): its
                    # prompt tokens are charged to the budget as the engine counted them.
                    prompt_uncounted=routed.routing_request.prompt_tokens == 0,
                )
                # After the handler returns, aiohttp writes the response before the loop runs
                # the next callback: accounting stays off the client's latency.
                asyncio.get_running_loop().call_soon(
                    account, gw, routed, recorder.outcome, arrived, plan.stream
                )
    except GatewayError as err:
        gw.metrics.errors.labels(labels.route, err.code).inc()
        if not forwarded:
            status = str(err.status)
            gw.metrics.requests.labels(labels.route, labels.model, "none", status).inc()
        if kind.error_response is not None:
            return kind.error_response(err, request_id)
        return err.response(request_id)
    finally:
        gw.active_requests -= 1
        gw.request_ids.discard(request_id)
