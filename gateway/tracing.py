"""OpenTelemetry spans for the request path; exported over OTLP/HTTP only when configured.

Off by default: without an endpoint the tracer is a null tracer whose spans are one shared object
that does nothing (not even OpenTelemetry's context switching), so the request path pays a method
call per span and nothing leaves the process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, Status, StatusCode, Tracer
from opentelemetry.trace.span import INVALID_SPAN_CONTEXT

from gateway.errors import GatewayError


class _NullSpan(NonRecordingSpan):
    """The one span a ``NullTracer`` hands out: records nothing, enters and leaves for free."""

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def end(self, end_time: int | None = None) -> None:
        return None


_NULL_SPAN = _NullSpan(INVALID_SPAN_CONTEXT)


class NullTracer(Tracer):
    """Tracing off: every span is ``_NULL_SPAN``; the current context is never touched."""

    def start_span(self, name: str, *args: Any, **kwargs: Any) -> _NullSpan:  # type: ignore[override]
        return _NULL_SPAN

    def start_as_current_span(  # type: ignore[override]
        self, name: str, *args: Any, **kwargs: Any
    ) -> _NullSpan:
        return _NULL_SPAN


def build_tracer(otlp_endpoint: str | None, service_name: str = "fleetgate-gateway") -> Tracer:
    """A tracer exporting to ``otlp_endpoint`` (e.g. ``http://collector:4318/v1/traces``)."""
    if not otlp_endpoint:
        return NullTracer()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider.get_tracer("fleetgate.gateway")


def record_stage_spans(
    tracer: Tracer, parent_start_ns: int, timings_ms: dict[str, float], names: dict[str, str]
) -> None:
    """Child spans for stages timed inside the engine (index lookup, scoring), back to back.

    The engine reports durations, not timestamps; laying them end to end from the decision's start
    keeps their order and lengths, which is what a trace reader needs.
    """
    if isinstance(tracer, NullTracer):
        return
    cursor = parent_start_ns
    for key, span_name in names.items():
        duration_ms = timings_ms.get(key)
        if duration_ms is None:
            continue
        end = cursor + int(duration_ms * 1e6)
        span = tracer.start_span(span_name, start_time=cursor)
        span.set_attribute("fleetgate.duration_ms", duration_ms)
        span.end(end_time=end)
        cursor = end


#: W3C trace-context headers (https://www.w3.org/TR/trace-context/): what vLLM's own
#: OpenTelemetry tracing (``--otlp-traces-endpoint``) reads to join a request's trace.
TRACE_HEADERS = ("traceparent", "tracestate")


def client_context(tracer: Tracer, headers: Mapping[str, str]) -> Context | None:
    """The client's trace context (its ``traceparent``), for the gateway's request span to join;
    None with tracing off."""
    if isinstance(tracer, NullTracer) or "traceparent" not in headers:
        return None
    return propagate.extract(headers)


def upstream_trace_headers(client_headers: Mapping[str, str]) -> dict[str, str]:
    """The trace-context headers to send an engine: the gateway's current span (its
    ``fleetgate.upstream``) as the parent with tracing on; with it off, the client's own
    ``traceparent``/``tracestate`` as they came, so an engine's trace still joins the client's."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        propagate.inject(carrier)
        return carrier
    for name in TRACE_HEADERS:
        value = client_headers.get(name)
        if value is not None:
            carrier[name] = value
    return carrier


__all__ = [
    "NullTracer",
    "build_tracer",
    "client_context",
    "record_stage_spans",
    "trace",
    "upstream_trace_headers",
]


def stage_span(tracer: Tracer, name: str) -> Any:
    """A stage's span inside the request's (tokenize, route, upstream). An error raised through
    it is the request's outcome, recorded once on the root span by ``request_span``: recorded
    here too, a client's 400 put the client's text (a key pasted into a message) into the
    stage's exception event (the diff review)."""
    return tracer.start_as_current_span(
        name, record_exception=False, set_status_on_exception=False
    )


@contextlib.contextmanager
def request_span(tracer: Tracer, name: str, context: Context | None) -> Iterator[Span]:
    """The request's root span. The gateway's own error answers are outcomes, not exceptions:
    a client's 4xx records its code and status, never the exception with its message (which
    quotes what the client sent: a key pasted into ``model`` reached the trace backend, the
    security review found), and a 5xx marks the span failed with its code. Anything else
    raised is a bug, recorded as an exception."""
    with tracer.start_as_current_span(
        name, context=context, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except GatewayError as err:
            span.set_attribute("fleetgate.error_code", err.code)
            span.set_attribute("http.response.status_code", err.status)
            if err.status >= 500:
                span.set_status(Status(StatusCode.ERROR, err.code))
            raise
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
