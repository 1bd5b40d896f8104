"""OpenTelemetry spans for the request path; exported over OTLP/HTTP only when configured.

Off by default: without an endpoint the tracer is OpenTelemetry's no-op tracer, so spans cost a
few attribute assignments and nothing leaves the process.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import NoOpTracerProvider, Tracer


def build_tracer(otlp_endpoint: str | None, service_name: str = "fleetgate-gateway") -> Tracer:
    """A tracer exporting to ``otlp_endpoint`` (e.g. ``http://collector:4318/v1/traces``)."""
    if not otlp_endpoint:
        return NoOpTracerProvider().get_tracer("fleetgate.gateway")
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


__all__ = ["build_tracer", "record_stage_spans", "trace"]
