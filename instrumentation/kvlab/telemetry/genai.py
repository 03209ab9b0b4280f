"""The GenAI semantic-convention attributes every kvlab inference span starts with.

One place for what the client (Locust), gateway and engine spans share (docs/tracing.md): the
role the readers find them by, `gen_ai.provider.name` (required) and the
`server.address`/`server.port` of the server called (client spans) or reached (server spans).
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvlab.telemetry import names


@lru_cache(maxsize=1024)
def server_of(url: str) -> tuple[str, int]:
    """(host, port) of a URL, the scheme's port when none is given."""
    u = urlsplit(url)
    return u.hostname or "", u.port or (443 if u.scheme == "https" else 80)


def span_attributes(role: str, url: str) -> dict[str, str | int]:
    host, port = server_of(url)
    return {names.SPAN_ROLE: role, names.GEN_AI_PROVIDER_NAME: names.GEN_AI_PROVIDER_VLLM,
            names.SERVER_ADDRESS: host, names.SERVER_PORT: port}


def call_of(request_span: trace.Span, role: str, url: str) -> tuple[str, dict[str, str | int]]:
    """Name and start attributes of a call to a replica made for `request_span`: the same GenAI
    operation and model (read back from a recording span; a non-recording one has neither). A call
    llm-d names (the P/D proxy's legs) has its name; any other is `{operation} {model}`."""
    attrs = span_attributes(role, url)
    recorded = getattr(request_span, "attributes", None) or {}
    for key in (names.GEN_AI_OPERATION_NAME, names.GEN_AI_REQUEST_MODEL):
        if isinstance(recorded.get(key), str):
            attrs[key] = recorded[key]
    if role in names.UPSTREAM_NAMED_CALLS:
        return role, attrs
    operation = attrs.get(names.GEN_AI_OPERATION_NAME)
    return (names.genai_span_name(operation, attrs.get(names.GEN_AI_REQUEST_MODEL))
            if isinstance(operation, str) else role), attrs


def client_gone(span: trace.Span) -> None:
    """Mark `span` ended by the client going away: OTel leaves a span that a CancelledError ends
    unmarked, and a readers' "ok" span must be one that finished."""
    span.set_status(Status(StatusCode.ERROR, "client disconnected"))
    span.set_attribute(names.ERROR_TYPE, "client_disconnected")
