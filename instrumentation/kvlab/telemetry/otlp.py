"""OTLP/protobuf request bytes written straight from the relay's packed spans (`packed.pack`).

The SDK's encoder builds a protobuf message object per span, attribute and value in Python:
~83 µs a gateway span, most of the export child's CPU (docs/benchmarks.md, "Tracing cost"). A
span's wire form is simple, and most of its attributes repeat from request to request (model,
provider, replica, policy, span role), so `OtlpEncoder` writes the wire bytes itself and keeps the
encoded key-value of every recurring string or bool attribute.

It writes what the SDK's `encode_spans` writes for the same spans (same fields, same order, same
grouping by scope; tests/test_otlp_encoder.py compares the bytes). Any span outside the
common shape (links, an attribute that is neither a plain scalar nor a list of one scalar type, an
`OTEL_*_LIMIT` that would cut it) is encoded by the SDK itself, so its limits and cleaning rules
apply exactly.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
from opentelemetry.trace import SpanContext, TraceFlags

from kvlab.telemetry.packed import unpack

_Packed = Sequence[Any]
_INT64 = (-(2 ** 63), 2 ** 63 - 1)
_CACHE_MAX = 8192          # recurring key-values kept; cleared when full (ids and counts never enter)
_HAS_IS_REMOTE = 0x100     # SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = 0x200
_ARRAY_ITEMS = (str, bool, int, float)
_double = struct.Struct("<d").pack
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack


def _varint_of(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = tuple(_varint_of(n) for n in range(1 << 14))   # lengths, kinds, counts: one or two bytes, looked up


def _varint(n: int) -> bytes:
    return _SMALL[n] if 0 <= n < 16384 else _varint_of(n)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + _varint(len(payload)) + payload


def _text(tag: bytes, text: str) -> bytes:
    """A string field; proto3 leaves an empty one out."""
    return _field(tag, text.encode("utf-8", "surrogatepass")) if text else b""


def _scalar(value: Any) -> bytes | None:
    """An AnyValue of a plain scalar, None for anything the SDK should handle."""
    if value is True or value is False:
        return b"\x10\x01" if value else b"\x10\x00"
    kind = type(value)
    if kind is str:
        return _field(b"\x0a", value.encode("utf-8", "surrogatepass"))
    if kind is int:
        return b"\x18" + _varint(value) if _INT64[0] <= value <= _INT64[1] else None
    if kind is float:
        return b"\x21" + _double(value)
    if kind is list or kind is tuple:
        return _array(value)
    return None


def _array(values: Sequence[Any]) -> bytes | None:
    """An AnyValue array of plain scalars of one type (the picker's top endpoints and scores), None
    for an empty, mixed or nested one: the SDK's cleaning decides those."""
    if not values:
        return None
    kind = type(values[0])
    if kind not in _ARRAY_ITEMS:
        return None
    parts = []
    for value in values:
        if type(value) is not kind:
            return None
        item = _scalar(value)
        if item is None:
            return None
        parts.append(_field(b"\x0a", item))
    return _field(b"\x2a", b"".join(parts))


class OtlpEncoder:
    """ExportTraceServiceRequest bytes for batches of packed spans of one resource."""

    def __init__(self, resource: Resource, limits: SpanLimits) -> None:
        self._resource = resource
        self._limits = limits
        self._max_attrs = limits.max_span_attributes
        self._max_events = limits.max_events
        self._max_event_attrs = limits.max_event_attributes
        self._plain = limits.max_attribute_length is None
        # the resource is the same in every request: encoded once, by the SDK
        probe = ReadableSpan(name="resource", resource=resource,
                             context=SpanContext(1, 1, False, TraceFlags(TraceFlags.SAMPLED)))
        self._resource_field = _field(b"\x0a", encode_spans([probe]).resource_spans[0].resource.SerializeToString())
        self._scopes: dict[tuple[str, str | None], bytes] = {}
        # encoded key-values by field tag (span attributes and event attributes differ)
        self._kv: dict[bytes, dict[tuple[str, Any], bytes]] = {b"\x4a": {}, b"\x1a": {}}
        # and, for values that do not recur (counts, scores, times), each key's encoded prefix; span names
        self._keys: dict[str, bytes] = {}
        self._names: dict[str, bytes] = {}

    def encode(self, batch: Sequence[_Packed]) -> bytes:
        by_scope: dict[tuple[str, str | None], list[bytes]] = {}
        for packed in batch:
            span = self._span(packed)
            if span is None:
                span = self._sdk_span(packed)
            by_scope.setdefault((packed[14], packed[15]), []).append(span)
        scope_spans = b"".join(_field(b"\x12", self._scope(scope) + b"".join(spans))
                               for scope, spans in by_scope.items())
        return _field(b"\x0a", self._resource_field + scope_spans)

    def _scope(self, scope: tuple[str, str | None]) -> bytes:
        encoded = self._scopes.get(scope)
        if encoded is None:
            name, version = scope
            body = _text(b"\x0a", name) + _text(b"\x12", version or "")
            encoded = self._scopes[scope] = _field(b"\x0a", body)
        return encoded

    def _attributes(self, attrs: dict[str, Any], tag: bytes, limit: int | None) -> bytes | None:
        """Repeated KeyValue fields, or None when the SDK must clean or cut them."""
        if not attrs:
            return b""
        if limit is not None and len(attrs) > limit:
            return None
        cache = self._kv[tag]
        parts = []
        for key, value in attrs.items():
            recurring = type(value) is str or type(value) is bool   # ints and floats are counts, ids, times
            kv = cache.get((key, value)) if recurring else None
            if kv is None:
                if type(key) is not str or not key:
                    return None
                any_value = _scalar(value)
                if any_value is None:
                    return None
                prefix = self._keys.get(key)
                if prefix is None:
                    if len(self._keys) >= _CACHE_MAX:
                        self._keys.clear()
                    prefix = self._keys[key] = _text(b"\x0a", key) + b"\x12"
                kv = _field(tag, prefix + _varint(len(any_value)) + any_value)
                if recurring:
                    if len(cache) >= _CACHE_MAX:
                        cache.clear()
                    cache[(key, value)] = kv
            parts.append(kv)
        return b"".join(parts)

    def _span(self, p: _Packed) -> bytes | None:
        (name, trace_id, span_id, _flags, parent_id, parent_remote, kind, start, end, attrs,
         events, links, code, description, _scope_name, _scope_version) = p
        if links or not self._plain or (self._max_events is not None and len(events) > self._max_events):
            return None
        encoded_attrs = self._attributes(attrs, b"\x4a", self._max_attrs)
        if encoded_attrs is None:
            return None
        body = [b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big")]
        if parent_id:
            body += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        encoded_name = self._names.get(name)
        if encoded_name is None:
            if len(self._names) >= _CACHE_MAX:
                self._names.clear()
            encoded_name = self._names[name] = _text(b"\x2a", name)
        body += (encoded_name, b"\x30", _varint(kind + 1),
                 b"\x39" + _fixed64(start) if start else b"", b"\x41" + _fixed64(end) if end else b"",
                 encoded_attrs)
        for event_name, timestamp, event_attrs in events:
            encoded = self._attributes(event_attrs, b"\x1a", self._max_event_attrs)
            if encoded is None:
                return None
            body.append(_field(b"\x5a", b"\x09" + _fixed64(timestamp)
                               + _text(b"\x12", event_name) + encoded))
        status = _text(b"\x12", description or "")
        if code:
            status += b"\x18" + _varint(code)
        body += (_field(b"\x7a", status), b"\x85\x01",
                 _fixed32(_HAS_IS_REMOTE | (_IS_REMOTE if parent_id and parent_remote else 0)))
        return _field(b"\x12", b"".join(body))

    def _sdk_span(self, packed: _Packed) -> bytes:
        """One span as the SDK encodes it (its limits, cleaning and error for what OTLP cannot
        carry apply)."""
        request = encode_spans([unpack(packed, self._resource, self._limits)])
        return _field(b"\x12", request.resource_spans[0].scope_spans[0].spans[0].SerializeToString())
