"""Process-level OpenTelemetry setup from the standard OTEL_* environment variables.

Called once at process start by a server or CLI (never by instrumented code). Exports only when
an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or `..._TRACES_ENDPOINT`) and
`OTEL_TRACES_EXPORTER` is not `none`; otherwise spans are still created (so trace context still
propagates) but go nowhere. Export runs in a background batch processor: a dead trace backend
costs dropped spans and a log line, never a failed request. Sampling follows
`OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (the SDK reads them).
"""

from __future__ import annotations

import logging
import os

from opentelemetry import propagate, trace
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.baggage.propagation import W3CBaggagePropagator

log = logging.getLogger(__name__)

_configured: TracerProvider | None = None


def otlp_endpoint() -> str | None:
    """The configured OTLP traces endpoint, or None when export is off."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def _exporter():
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    # the exporter reads endpoint, headers and timeout from the same OTEL_* variables
    return OTLPSpanExporter()


def configure_tracing(service_name: str, extra: SpanProcessor | None = None,
                      attributes: dict[str, str] | None = None) -> TracerProvider:
    """Install the global TracerProvider for this process (idempotent) and W3C propagators.

    `extra` adds a span processor (tests pass an in-memory exporter's processor).
    `OTEL_SERVICE_NAME` overrides `service_name`.
    """
    global _configured
    if _configured is None and isinstance(trace.get_tracer_provider(), TracerProvider):
        # OTel allows one global provider per process: after a shutdown_tracing() in the same
        # process (tests run servers in-process), keep using it rather than failing to replace it
        _configured = trace.get_tracer_provider()  # type: ignore[assignment]
    if _configured is not None:
        if extra is not None:
            _configured.add_span_processor(extra)
        return _configured
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name),
                                **(attributes or {})})
    provider = TracerProvider(resource=resource)
    if otlp_endpoint():
        try:
            provider.add_span_processor(BatchSpanProcessor(_exporter()))
        except Exception as exc:  # telemetry never breaks the caller
            log.warning("OTLP trace export disabled: %s", exc)
    if extra is not None:
        provider.add_span_processor(extra)
    trace.set_tracer_provider(provider)
    propagate.set_global_textmap(CompositePropagator(
        [TraceContextTextMapPropagator(), W3CBaggagePropagator()]))
    # the OTLP exporter logs every failed export at ERROR; one warning is enough for us
    logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").setLevel(logging.CRITICAL)
    logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").setLevel(logging.CRITICAL)
    _configured = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop export (bounded by the SDK's own timeouts)."""
    global _configured
    if _configured is not None:
        try:
            _configured.shutdown()
        except Exception as exc:
            log.warning("trace shutdown: %s", exc)
        _configured = None
