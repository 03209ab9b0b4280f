"""The Endpoint Picker protocol on top of Envoy's external processing (ext_proc v3) messages.

Wire facts from the Inference Extension's protocol (docs/proposals/004-endpoint-picker-protocol):
the picked endpoints travel as `ip:port[,ip:port...]` both in the `x-gateway-destination-endpoint`
request header and in the `envoy.lb` dynamic-metadata namespace under the same key (the two must
agree); the proxy MAY restrict the choice with a list under `envoy.lb.subset_hint` /
`x-gateway-destination-endpoint-subset`, and reports the endpoint that actually served under
`envoy.lb` / `x-gateway-destination-endpoint-served`. No endpoint: an immediate 503.
This module only builds and reads messages; `stream.py` holds the per-request state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvlab.epp import (
    DESTINATION_HEADER,
    METADATA_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from kvlab.errors import RequestError

FULL_DUPLEX = "FULL_DUPLEX_STREAMED"


def headers_of(msg: ext_proc.HttpHeaders) -> dict[str, str]:
    """Lower-cased header map; Envoy sends values in `raw_value` (bytes) or `value`."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out[h.key.lower()] = value
    return out


def body_modes(req: ext_proc.ProcessingRequest) -> tuple[str, str]:
    """(request, response) body modes the proxy announced on the stream's first message; an EPP
    MUST support full-duplex streaming, so that is what a proxy that says nothing is taken to use."""
    if not req.HasField("protocol_config"):
        return FULL_DUPLEX, FULL_DUPLEX
    mode = ProcessingMode.BodySendMode
    cfg = req.protocol_config
    return mode.Name(cfg.request_body_mode), mode.Name(cfg.response_body_mode)


def _metadata_value(req: ext_proc.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    md = req.metadata_context.filter_metadata
    if namespace not in md or key not in md[namespace].fields:
        return None
    value: struct_pb2.Value = md[namespace].fields[key]
    return value


def subset_hint(req: ext_proc.ProcessingRequest) -> set[str] | None:
    """The endpoints the proxy allows (`ip:port`), or None when it sets no hint."""
    value = _metadata_value(req, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        return {v.string_value for v in value.list_value.values if v.string_value}
    return {s.strip() for s in value.string_value.split(",") if s.strip()}


def served_endpoint(req: ext_proc.ProcessingRequest) -> str | None:
    value = _metadata_value(req, METADATA_NAMESPACE, SERVED_KEY)
    return value.string_value or None if value is not None else None


def _header_mutation(headers: Mapping[str, str]) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in headers.items()])


def destination_metadata(endpoints: Iterable[str]) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({METADATA_NAMESPACE: {DESTINATION_HEADER: ",".join(endpoints)}})
    return md


def common(headers: Mapping[str, str] | None = None, body: bytes | None = None,
           end_of_stream: bool = False, clear_route_cache: bool = False) -> ext_proc.CommonResponse:
    """A CONTINUE answer, with header mutations and, in full-duplex mode, the body passed on."""
    out = ext_proc.CommonResponse(clear_route_cache=clear_route_cache)
    if headers:
        out.header_mutation.CopyFrom(_header_mutation(headers))
    if body is not None:
        out.body_mutation.streamed_response.CopyFrom(
            ext_proc.StreamedBodyResponse(body=body, end_of_stream=end_of_stream))
    return out


def request_headers(cr: ext_proc.CommonResponse, endpoints: list[str] | None = None) -> ext_proc.ProcessingResponse:
    out = ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=cr))
    if endpoints:
        out.dynamic_metadata.CopyFrom(destination_metadata(endpoints))
    return out


def request_body(cr: ext_proc.CommonResponse, endpoints: list[str] | None = None) -> ext_proc.ProcessingResponse:
    out = ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=cr))
    if endpoints:
        out.dynamic_metadata.CopyFrom(destination_metadata(endpoints))
    return out


def response_headers(cr: ext_proc.CommonResponse) -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse(response=cr))


def response_body(cr: ext_proc.CommonResponse) -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse(response=cr))


def trailers(request: bool) -> ext_proc.ProcessingResponse:
    t = ext_proc.TrailersResponse()
    return (ext_proc.ProcessingResponse(request_trailers=t) if request
            else ext_proc.ProcessingResponse(response_trailers=t))


def immediate(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> ext_proc.ProcessingResponse:
    """Answer the client without reaching any replica (a 4xx for a bad request, 503 for no endpoint)."""
    resp = ext_proc.ImmediateResponse(status=http_status_pb2.HttpStatus(code=status), body=body,
                                      details=f"kvlab_epp_{status}")
    resp.headers.CopyFrom(_header_mutation({"content-type": "application/json", **(headers or {})}))
    return ext_proc.ProcessingResponse(immediate_response=resp)


def error(err: RequestError, headers: Mapping[str, str] | None = None) -> ext_proc.ProcessingResponse:
    return immediate(err.status, msgspec.json.encode(err.to_json()), headers)
