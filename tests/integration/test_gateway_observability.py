"""Spans of the request path, and routing that degrades (index down) instead of failing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.state import GATEWAY
from routing.contracts import IndexStats, IndexUnavailable
from routing.types import BlockHash, Epoch, ReplicaId
from tests.integration.test_gateway_support import FakeUpstream, serve

BODY = {"model": "base-model", "prompt": "a prompt long enough for a few blocks " * 4}


class DownIndex:
    """A block index whose backend is unreachable."""

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        raise IndexUnavailable("down")

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        raise IndexUnavailable("down")

    async def record(
        self,
        replica: ReplicaId,
        epoch: Epoch,
        blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        raise IndexUnavailable("down")

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        raise IndexUnavailable("down")

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        raise IndexUnavailable("down")

    async def heartbeat(self, replica: ReplicaId, ttl_s: float) -> None:
        raise IndexUnavailable("down")

    async def stats(self) -> IndexStats:
        raise IndexUnavailable("down")

    async def close(self) -> None:
        return None


async def test_index_outage_degrades_to_load_only_routing() -> None:
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        app = create_app(
            GatewayConfig(health_interval_s=3600, admin_key="adm"),
            GatewayPolicy.default([spec]),
            index=DownIndex(),
        )
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json=BODY) as resp:
                assert resp.status == 200
            async with http.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
            headers = {"Authorization": "Bearer adm"}
            async with http.get(f"{url}/admin/index", headers=headers) as resp:
                index = await resp.json()
    assert (
        'fleetgate_degraded_decisions_total{reason="index_unavailable",route="default"} 1.0'
        in metrics
    )
    assert index["available"] is False


def _recording_tracer() -> tuple[InMemorySpanExporter, TracerProvider]:
    """A tracer provider whose finished spans the exporter keeps, for the test to read."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider


@asynccontextmanager
async def _traced_gateway(provider: TracerProvider) -> AsyncIterator[str]:
    """A gateway over one fake engine whose spans go to ``provider``; yields its URL."""
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        app[GATEWAY].tracer = provider.get_tracer("test")
        async with serve(app, handler_cancellation=True) as url:
            yield url


async def test_request_spans_cover_every_stage() -> None:
    exporter, provider = _recording_tracer()
    async with (
        _traced_gateway(provider) as url, aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json=BODY) as resp,
    ):
        assert resp.status == 200
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) >= {
        "fleetgate.request",
        "fleetgate.tokenize",
        "fleetgate.route",
        "fleetgate.index_lookup",
        "fleetgate.scoring",
        "fleetgate.upstream",
    }
    root = spans["fleetgate.request"]
    for name in ("fleetgate.tokenize", "fleetgate.route", "fleetgate.upstream"):
        assert spans[name].parent is not None
        assert spans[name].parent.span_id == root.context.span_id
    assert spans["fleetgate.route"].attributes["fleetgate.replica"] == "r0"


CLIENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_trace_context_reaches_the_engine() -> None:
    """The engine gets a W3C ``traceparent``, so vLLM's own spans join the request's trace: with
    tracing on, the gateway's upstream span (in the client's trace when it sent one) is the
    parent; with it off, the client's header goes through as it came."""
    exporter, provider = _recording_tracer()
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        for tracing in (False, True):
            app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
            if tracing:
                app[GATEWAY].tracer = provider.get_tracer("test")
            async with serve(app) as url, aiohttp.ClientSession() as http:
                for headers in ({}, {"traceparent": CLIENT_TRACE, "tracestate": "k=v"}):
                    async with http.post(
                        f"{url}/v1/completions", json=BODY, headers=headers
                    ) as resp:
                        assert resp.status == 200
    sent = [(h.get("traceparent"), h.get("tracestate")) for h in upstream.headers]
    assert sent[0] == (None, None)  # off, none sent: none invented
    assert sent[1] == (CLIENT_TRACE, "k=v")  # off: the client's, untouched
    upstream_spans = [s for s in exporter.get_finished_spans() if s.name == "fleetgate.upstream"]
    for (traceparent, _), span in zip(sent[2:], upstream_spans, strict=True):
        ctx = span.context
        assert traceparent.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    # The second traced request joined the client's trace.
    assert f"{upstream_spans[1].context.trace_id:032x}" == CLIENT_TRACE.split("-")[1]
    assert f"{upstream_spans[0].context.trace_id:032x}" != CLIENT_TRACE.split("-")[1]


async def test_a_clients_error_is_an_outcome_on_its_span_not_an_exception_quoting_it() -> None:
    """The security review: every client 4xx added an exception event to the request's span,
    message and stack included, so a key pasted into ``model`` reached the trace backend."""
    exporter, provider = _recording_tracer()
    async with _traced_gateway(provider) as url, aiohttp.ClientSession() as http:
        async with http.post(
            f"{url}/v1/completions", json={**BODY, "model": "sk-live-CANARY-1234"}
        ) as resp:
            assert resp.status == 404
        # ... and through a stage's span: the chat template refuses the message (a 400).
        bad = {"model": BODY["model"],
               "messages": [{"role": "user", "content": [7, "sk-live-CANARY-5678"]}]}
        async with http.post(f"{url}/v1/chat/completions", json=bad) as resp:
            assert resp.status == 400
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "fleetgate.request"]
    assert [r.attributes["http.response.status_code"] for r in roots] == [404, 400]
    assert roots[0].attributes["fleetgate.error_code"] == "model_not_found"
    for span in spans:  # the root and every stage under it
        assert span.events == (), span.name
        assert "CANARY" not in str(span.to_json()), span.name
