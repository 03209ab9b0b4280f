"""A finished span as a plain tuple: what a serving process sends its exporting child
(`span_export.SpanRelay`), and the span rebuilt from it there (`unpack`, which `otlp.OtlpEncoder`
reads too)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

Packed = tuple[Any, ...]


def pack(span: ReadableSpan) -> Packed:
    """The fields OTLP carries, as msgpack-able values (trace ids as 16 bytes, enums as values)."""
    ctx = span.context
    parent = span.parent
    scope = span.instrumentation_scope
    return (span.name, ctx.trace_id.to_bytes(16, "big"), ctx.span_id, int(ctx.trace_flags),
            parent.span_id if parent else 0, bool(parent and parent.is_remote), span.kind.value,
            span.start_time, span.end_time, dict(span.attributes or {}),
            [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events],
            [(ln.context.trace_id.to_bytes(16, "big"), ln.context.span_id, int(ln.context.trace_flags),
              ln.context.is_remote, dict(ln.attributes or {})) for ln in span.links],
            span.status.status_code.value, span.status.description,
            scope.name if scope else "", scope.version if scope else None)


def unpack(p: Sequence[Any], resource: Resource, limits: SpanLimits) -> ReadableSpan:
    """The span again, with the SDK's attribute cleaning and OTEL_*_LIMIT limits applied here
    (in the child) rather than in the serving process."""
    (name, trace_id, span_id, flags, parent_id, parent_remote, kind, start, end, attrs,
     events, links, code, description, scope_name, scope_version) = p
    trace_id = int.from_bytes(trace_id, "big")
    length = limits.max_attribute_length
    return ReadableSpan(
        name=name, context=SpanContext(trace_id, span_id, False, TraceFlags(flags)),
        parent=SpanContext(trace_id, parent_id, parent_remote, TraceFlags(flags)) if parent_id else None,
        resource=resource, attributes=BoundedAttributes(limits.max_span_attributes, attrs, max_value_len=length),
        events=[Event(n, BoundedAttributes(limits.max_event_attributes, a, max_value_len=length), timestamp=t)
                for n, t, a in deque(events, maxlen=limits.max_events)],
        links=[Link(SpanContext(int.from_bytes(t, "big"), s, remote, TraceFlags(f)),
                    BoundedAttributes(limits.max_link_attributes, a, max_value_len=length))
               for t, s, f, remote, a in deque(links, maxlen=limits.max_links)],   # the last ones, as the SDK keeps
        kind=SpanKind(kind), status=Status(StatusCode(code), description),
        start_time=start, end_time=end, instrumentation_scope=InstrumentationScope(scope_name, scope_version))
