"""Process-level OpenTelemetry setup from the standard OTEL_* environment variables.

Called once at process start by a server or CLI (never by instrumented code). Every variable the
Python SDK defines for traces is read by the SDK itself; this module only wires the pieces:

- `OTEL_PROPAGATORS`: the API builds the global propagator from it at import (default
  `tracecontext,baggage`); nothing here replaces it.
- `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`: the SDK's TracerProvider reads its own names;
  other names are the SDK's `opentelemetry_traces_sampler` entry points. Unset, kvlab's processes
  sample at most 200 new traces a second, parent-based (`kvlab.telemetry.sampling`).
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

from opentelemetry import trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from kvlab.telemetry.recorder import RecorderProvider
from kvlab.telemetry.sampling import sampler_from_env
from kvlab.telemetry.span_export import SpanRelay, build_exporter

log = logging.getLogger(__name__)

_configured: TracerProvider | RecorderProvider | None = None
EXPORT_PROCESS_ENV = "KVLAB_TRACES_EXPORT_PROCESS"
_EXPORT_MODES = {"0": "sdk", "": "sdk", "1": "recorder", "sdk": "relay"}
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


def configure_tracing(service_name: str, extra: SpanProcessor | None = None,
                      attributes: dict[str, str] | None = None,
                      export_process: bool = False) -> TracerProvider | RecorderProvider:
    """Install the global TracerProvider for this process (idempotent).

    `service_name` and `attributes` are defaults that `OTEL_SERVICE_NAME` and
    `OTEL_RESOURCE_ATTRIBUTES` override. `extra` adds a span processor (tests pass an in-memory
    exporter's processor; the stack process its own OTLP exporter). `export_process` is what
    servers use: spans are recorded by `kvlab.telemetry.recorder` (the API without the SDK's span
    bookkeeping) and exported by a child process (`kvlab.telemetry.span_export`), so that neither
    recording nor encoding spans competes with the event loop for the GIL.
    `KVLAB_TRACES_EXPORT_PROCESS` overrides it: `0` the SDK's spans and in-process
    BatchSpanProcessor, `1` recorder + relay, `sdk` the SDK's spans through the relay. An `extra`
    processor or `OTEL_SDK_DISABLED=true` needs the SDK's spans, so they keep the SDK's provider.
    """
    global _configured
    current = trace.get_tracer_provider()
    if _configured is None and isinstance(current, (TracerProvider, RecorderProvider)):
        # OTel allows one global provider per process: after a shutdown_tracing() in the same
        # process (tests run servers in-process), keep using it rather than failing to replace it
        _configured = current
    if _configured is not None:
        if extra is not None:
            if not isinstance(_configured, TracerProvider):
                raise RuntimeError("tracing is already configured with kvlab's span recorder; "
                                   "configure the extra span processor first")
            _configured.add_span_processor(extra)
        return _configured
    resource = Resource.create({"service.name": service_name, **(attributes or {})}).merge(
        OTELResourceDetector().detect())
    names = exporter_names()
    setting = os.environ.get(EXPORT_PROCESS_ENV, "1" if export_process else "0").strip().lower()
    if setting not in _EXPORT_MODES:
        log.warning("%s=%r is not one of 0, 1, sdk; using 1", EXPORT_PROCESS_ENV, setting)
    mode = _EXPORT_MODES.get(setting, "recorder")
    if mode == "recorder" and (extra is not None or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"):
        mode = "relay"
    provider: TracerProvider | RecorderProvider
    sampler = sampler_from_env()   # None: the SDK's own name, read by its TracerProvider
    if mode == "recorder":
        provider = RecorderProvider(resource, SpanRelay(names, resource) if names else None, sampler)
    else:
        provider = sdk_provider = TracerProvider(resource=resource, sampler=sampler)
        if mode == "relay" and names:
            sdk_provider.add_span_processor(SpanRelay(names, resource))
        else:
            for name in names:
                try:
                    sdk_provider.add_span_processor(BatchSpanProcessor(build_exporter(name)))
                except Exception as exc:  # telemetry never breaks the caller
                    log.warning("trace exporter %s disabled: %s", name, exc)
        if extra is not None:
            sdk_provider.add_span_processor(extra)
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
