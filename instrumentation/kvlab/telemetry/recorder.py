"""Spans recorded straight into the relay's format: the OpenTelemetry API without the SDK's span.

At 100 % sampling the SDK's span costs the serving process more than the request it describes:
every `set_attribute` takes a lock and cleans the value (`BoundedAttributes`), `start_span` builds
a span with its own lock and limit bookkeeping, `end` copies it into a `ReadableSpan`, and the
garbage of all that triggers the cyclic GC (docs/benchmarks.md, "Tracing cost"). A server that
exports through `kvlab.telemetry.span_export` needs none of it in-process: the relay's child rebuilds
`ReadableSpan`s, applies the SDK's attribute cleaning and `OTEL_*_LIMIT`s, and runs the SDK's
exporters. So `RecorderProvider` implements the API (`TracerProvider`/`Tracer`/`Span`) with plain
fields and hands each sampled span to the relay as one tuple when it ends.

What stays the SDK's: the sampler (`OTEL_TRACES_SAMPLER`/`_ARG`, parent-based by default), the
W3C ids and flags (its id generator), the resource, and everything after the pipe. Values
that are not plain scalars go through the SDK's own `BoundedAttributes` at once, so what reaches
the pipe is always encodable. tests/test_span_relay.py checks that a span tree recorded here is
exported exactly as the SDK exports it in-process.
"""

from __future__ import annotations

import atexit
import logging
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from time import time_ns
from types import MappingProxyType, TracebackType
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode
from opentelemetry.util import types

from kvlab.telemetry.span_export import SpanRelay

log = logging.getLogger(__name__)

_SCALAR = (str, bool, int, float)
_SAMPLED_RANDOM = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_RANDOM = TraceFlags(TraceFlags.RANDOM_TRACE_ID)
_INTERNAL = SpanKind.INTERNAL._value_
_UNSET = StatusCode.UNSET._value_


def _cleaned(attributes: types.Attributes) -> dict[str, Any]:
    """Plain scalars as they are (the common case, no copy of each), anything else as the SDK
    cleans it."""
    if not attributes:
        return {}
    out = dict(attributes)
    for key, value in out.items():
        if not isinstance(value, _SCALAR):
            if type(value) is list and value and all(type(v) is type(value[0]) for v in value) \
                    and type(value[0]) in _SCALAR:
                out[key] = tuple(value)   # what the SDK makes of a list of one scalar type
            else:
                return dict(BoundedAttributes(None, attributes))
    return out


class RecordedSpan(trace_api.Span):
    """A sampled span of a `RecorderTracer` (unsampled ones are the API's NonRecordingSpan):
    fields only, packed for the relay at `end`."""

    def __init__(self, tracer: RecorderTracer, name: str, context: SpanContext, parent: SpanContext | None,
                 kind: SpanKind, attributes: dict[str, Any], links: Sequence[Link], start: int,
                 record_exception: bool, set_status_on_exception: bool) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._start = start
        self._end: int | None = None
        self._attributes = attributes
        self._events: list[tuple[str, int, dict[str, Any]]] = []
        self._links = list(links)
        self._status = Status(StatusCode.UNSET)
        self._record_exception = record_exception
        self._set_status_on_exception = set_status_on_exception
        self._child_fields: tuple[bytes, int] | None = None   # record_child's trace id and flags

    def get_span_context(self) -> SpanContext:
        return self._context

    @property
    def name(self) -> str:   # read back as from the SDK's span (telemetry.genai.call_of does)
        return self._name

    @property
    def attributes(self) -> Mapping[str, Any]:
        return MappingProxyType(self._attributes)

    def is_recording(self) -> bool:
        return self._end is None

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        if self._end is not None:
            log.warning("Setting attribute on ended span.")
        elif isinstance(value, _SCALAR):
            self._attributes[key] = value
        else:
            self._attributes.update(_cleaned({key: value}))

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        if self._end is not None:
            log.warning("Setting attribute on ended span.")
        else:
            self._attributes.update(_cleaned(attributes))

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        if self._end is None:
            self._events.append((name, timestamp if timestamp is not None else time_ns(), _cleaned(attributes)))

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if self._end is None and context.is_valid:
            self._links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self._end is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # the SDK's rules: OK is final, UNSET is never set, a description only with ERROR
        if self._end is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(self, exception: BaseException, attributes: types.Attributes = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        module, qualname = type(exception).__module__, type(exception).__qualname__
        recorded: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        recorded.update(attributes or {})
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end is not None:
            log.warning("Calling end() on an ended span.")
            return
        self._end = end = end_time if end_time is not None else time_ns()
        relay = self._tracer.relay
        if relay is None:
            return
        ctx, parent, status = self._context, self._parent, self._status
        # `_value_` (the enum's documented member value) rather than `.value`, a Python-level property
        relay.add((self._name, ctx.trace_id.to_bytes(16, "big"), ctx.span_id, int(ctx.trace_flags),
                   parent.span_id if parent else 0, bool(parent and parent.is_remote), self._kind._value_,
                   self._start, end, self._attributes, self._events,
                   [(ln.context.trace_id.to_bytes(16, "big"), ln.context.span_id, int(ln.context.trace_flags),
                     ln.context.is_remote, _cleaned(ln.attributes)) for ln in self._links] if self._links else [],
                   status.status_code._value_, status.description,
                   self._tracer.scope_name, self._tracer.scope_version))

    def record_child(self, name: str, start: int, end: int, attributes: dict[str, Any],
                     parent_id: int = 0) -> int:
        """An INTERNAL child of this span (or of its descendant `parent_id`) written after the fact,
        already ended, packed straight for the relay: no Span object, context or sampling decision
        (a sampled span's children are sampled, under every sampler OTEL_TRACES_SAMPLER names).
        It keeps `attributes` (the caller's own dict). The gateway writes llm-d's scheduling steps
        so (gateway/schedule_span.py). Returns the child's span id."""
        span_id: int = self._tracer.ids.generate_span_id()
        relay = self._tracer.relay
        if relay is not None:
            if self._child_fields is None:
                ctx = self._context
                self._child_fields = (ctx.trace_id.to_bytes(16, "big"), int(ctx.trace_flags))
            trace_id, flags = self._child_fields
            for value in attributes.values():
                if not isinstance(value, _SCALAR):
                    attributes = _cleaned(attributes)
                    break
            relay.add((name, trace_id, span_id, flags, parent_id or self._context.span_id, False, _INTERNAL,
                       start, end, attributes, [], [], _UNSET, None,
                       self._tracer.scope_name, self._tracer.scope_version))
        return span_id

    def __exit__(self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
                 exc_tb: TracebackType | None) -> None:
        if exc_val is not None and self._end is None:
            if self._record_exception:
                self.record_exception(exc_val, escaped=True)
            if self._set_status_on_exception:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()


class RecorderTracer(trace_api.Tracer):
    """Decides sampling and ids as the SDK's Tracer does; records sampled spans as `RecordedSpan`s."""

    def __init__(self, provider: RecorderProvider, name: str, version: str | None) -> None:
        self.relay = provider.relay
        self.scope_name = name
        self.scope_version = version
        self._sampler = provider.sampler
        self._follow_parent = type(provider.sampler) is ParentBased   # as built from OTEL_TRACES_SAMPLER
        self.ids = provider.ids

    def start_span(self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: types.Attributes = None, links: Sequence[Link] | None = (),
                   start_time: int | None = None, record_exception: bool = True,
                   set_status_on_exception: bool = True) -> trace_api.Span:
        parent: SpanContext | None = trace_api.get_current_span(context).get_span_context()
        links = links or ()
        if parent is not None and parent.is_valid and self._follow_parent:
            # what ParentBased decides with its default delegates (every parentbased_* of
            # OTEL_TRACES_SAMPLER): the parent's flag and trace state, without a SamplingResult
            trace_id = parent.trace_id
            random_id = parent.trace_flags.random_trace_id
            sampled = parent.trace_flags.sampled
            trace_state: TraceState | None = parent.trace_state
            sampler_attributes = None
        else:
            if parent is None or not parent.is_valid:
                parent = None
                trace_id = self.ids.generate_trace_id()
                random_id = True
            else:
                trace_id = parent.trace_id
                random_id = parent.trace_flags.random_trace_id
            decision = self._sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled = decision.decision is Decision.RECORD_AND_SAMPLE   # RECORD_ONLY would export nothing: dropped
            trace_state = decision.trace_state
            sampler_attributes = decision.attributes
        if sampled:
            flags = _SAMPLED_RANDOM if random_id else _SAMPLED
        else:
            flags = _RANDOM if random_id else TraceFlags(TraceFlags.DEFAULT)
        span_context = SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False,
                                   trace_flags=flags, trace_state=trace_state)
        if not sampled:
            return trace_api.NonRecordingSpan(span_context)
        recorded = _cleaned(attributes)
        if sampler_attributes:
            recorded.update(sampler_attributes)
        return RecordedSpan(self, name, span_context, parent, kind, recorded,
                            [ln for ln in links if ln.context.is_valid],
                            start_time if start_time is not None else time_ns(),
                            record_exception, set_status_on_exception)

    @contextmanager
    def start_as_current_span(  # type: ignore[override]  # the API types it with its private decorator
            self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
            attributes: types.Attributes = None, links: Sequence[Link] | None = (), start_time: int | None = None,
            record_exception: bool = True, set_status_on_exception: bool = True,
            end_on_exit: bool = True) -> Iterator[trace_api.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time, record_exception,
                               set_status_on_exception)
        with trace_api.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                                set_status_on_exception=set_status_on_exception) as current:
            yield current


class RecorderProvider(trace_api.TracerProvider):
    """The global TracerProvider of a server whose spans go through a `SpanRelay` (or nowhere, when
    no exporter is configured: spans are still made, so trace context still propagates)."""

    def __init__(self, resource: Resource, relay: SpanRelay | None, sampler: Sampler | None = None) -> None:
        self.resource = resource
        self.relay = relay
        # None: the SDK's sampler from OTEL_TRACES_SAMPLER[_ARG]
        sdk = TracerProvider(resource=resource, shutdown_on_exit=False, sampler=sampler)
        self.sampler = sdk.sampler
        self.ids = sdk.id_generator
        atexit.register(self.shutdown)   # as the SDK's provider does: spans still pending are sent

    def get_tracer(self, instrumenting_module_name: str, instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: types.Attributes = None) -> trace_api.Tracer:
        return RecorderTracer(self, instrumenting_module_name, instrumenting_library_version)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.relay.force_flush(timeout_millis) if self.relay is not None else True

    def shutdown(self) -> None:
        if self.relay is not None:
            self.relay.shutdown()
