"""Process-level OpenTelemetry setup from the standard OTEL_* environment variables.

Called once at process start by a server or CLI (never by instrumented code). Every variable the
Python SDK defines for traces is read by the SDK itself; this module only wires the pieces:

- `OTEL_PROPAGATORS`: the API builds the global propagator from it at import (default
  `tracecontext,baggage`); nothing here replaces it.
- `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`: the SDK's TracerProvider reads them.
- `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`: the SDK's resource detector; they win over the
  service name the caller passes (that one is only the default).
- `OTEL_TRACES_EXPORTER`: exporter names from the SDK's `opentelemetry_traces_exporter` entry
  points (`otlp`, `otlp_proto_http`, `otlp_proto_grpc`, `console`, comma-separated) or `none`.
  Unset: OTLP when an endpoint is configured, else nothing (spans are still created, so trace
  context still propagates; a lab process never sprays localhost:4318).
- `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` picks the `otlp` exporter (`http/protobuf` by default, as
  the specification says; `grpc`); endpoint, headers, timeout (seconds in the Python SDK),
  compression and certificates are read by the exporter from `OTEL_EXPORTER_OTLP_[TRACES_]*`.

Export runs in a background batch processor (`OTEL_BSP_*`): a dead trace backend costs dropped
spans and a log line, never a failed request; a misconfigured exporter costs a warning.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points

from opentelemetry import trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from kvlab.telemetry.relay import SpanRelay

log = logging.getLogger(__name__)

_configured: TracerProvider | None = None
EXPORT_PROCESS_ENV = "KVLAB_TRACES_EXPORT_PROCESS"
_OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


def exporter_names() -> list[str]:
    """The trace exporters this process should run (entry-point names), from the OTEL_* env."""
    configured = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if configured == "none":
        return []
    if not configured:
        endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        configured = "otlp" if endpoint else ""
    names = []
    for name in filter(None, (n.strip() for n in configured.split(","))):
        if name != "otlp":
            names.append(name)
            continue
        protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
        if protocol not in _OTLP_BY_PROTOCOL:
            log.warning("OTLP protocol %r is not supported for traces (use http/protobuf or grpc); "
                        "export disabled", protocol)
            continue
        names.append(_OTLP_BY_PROTOCOL[protocol])
    return names


def build_exporter(name: str) -> SpanExporter:
    """The installed exporter of that entry-point name, configured from the environment."""
    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        raise LookupError(f"no trace exporter named {name!r} is installed")
    exporter: SpanExporter = found[0].load()()   # each reads its endpoint, headers, timeout... from OTEL_* itself
    return exporter


def configure_tracing(service_name: str, extra: SpanProcessor | None = None,
                      attributes: dict[str, str] | None = None, export_process: bool = False) -> TracerProvider:
    """Install the global TracerProvider for this process (idempotent).

    `service_name` and `attributes` are defaults that `OTEL_SERVICE_NAME` and
    `OTEL_RESOURCE_ATTRIBUTES` override. `extra` adds a span processor (tests pass an in-memory
    exporter's processor; the stack process its own OTLP exporter). `export_process` runs the
    exporters in a child process (`kvlab.telemetry.relay`): what servers use, so that encoding
    spans does not compete with their event loop for the GIL; `KVLAB_TRACES_EXPORT_PROCESS=0|1`
    overrides it (0: the SDK's in-process BatchSpanProcessor).
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
    resource = Resource.create({"service.name": service_name, **(attributes or {})}).merge(
        OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)   # sampler from OTEL_TRACES_SAMPLER[_ARG]
    names = exporter_names()
    export_process = os.environ.get(EXPORT_PROCESS_ENV, "1" if export_process else "0").strip() not in ("0", "")
    if export_process and names:
        provider.add_span_processor(SpanRelay(names, resource))
    else:
        for name in names:
            try:
                provider.add_span_processor(BatchSpanProcessor(build_exporter(name)))
            except Exception as exc:  # telemetry never breaks the caller
                log.warning("trace exporter %s disabled: %s", name, exc)
    if extra is not None:
        provider.add_span_processor(extra)
    trace.set_tracer_provider(provider)
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
