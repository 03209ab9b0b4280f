"""The HTTP edge shared by the gateway and the simulator: bodies decoded defensively, errors as JSON.

Whatever a client sends, the answer is vLLM's OpenAI-shaped error body (`{"error": {message, type,
param, code}}`) with the status vLLM gives: 400 for a body that is not a JSON object of the right
shape (invalid JSON or UTF-8, nesting deeper than MAX_DEPTH, numbers out of range, a non-JSON
content type), 404/405 for unknown routes and methods, 413 past the size limit. Client input never
produces a 500 or aiohttp's plain-text pages; an unexpected exception is still answered as JSON
(500) and logged, so the fuzz tests see it. Duplicate keys keep the last value, as vLLM's parser does.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from kvlab.errors import RequestError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_DEPTH = 32            # OpenAI bodies nest 5 deep (messages → content parts → image_url → ...)
_JSON_MEDIA = ("application/json", "")   # vLLM requires application/json; an absent type is let through


class HTTPError(RequestError):
    """A protocol-level client error (404, 405, 413, ...) with vLLM's type: the status phrase."""

    def __init__(self, status: int, message: str | None = None) -> None:
        phrase = HTTPStatus(status).phrase
        super().__init__(message or phrase)
        self.status = status
        self.type = phrase


def json_error(err: RequestError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(err.to_json()), status=err.status,
                        content_type="application/json", headers=headers)


async def read_body(request: web.Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The raw body, after the content-type and size checks (413 past `limit` bytes, 408 when it
    does not arrive within `timeout_s`: a slow client never holds a handler for ever)."""
    media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media not in _JSON_MEDIA:
        raise RequestError("Unsupported Media Type: Only 'application/json' is allowed")
    if request.content_length is not None and request.content_length > limit:
        raise HTTPError(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}")
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise HTTPError(408, f"request body not received within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise HTTPError(413, f"request body exceeds the limit of {limit} bytes") from None


def _too_deep(obj: Any) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        for child in (o.values() if type(o) is dict else o):
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return False


def decode(raw: bytes, cls: type[T] | None = None) -> T:
    """Parse a JSON body (an object) into `cls` (default: dict), or raise a RequestError (400).
    A body with more brackets than MAX_DEPTH is parsed untyped first to measure its depth."""
    try:
        deep = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
        if cls is None or deep:
            obj = msgspec.json.decode(raw)
            if not isinstance(obj, dict):
                raise RequestError("request body must be a JSON object")
            if deep and _too_deep(obj):
                raise RequestError(f"request body nests deeper than {MAX_DEPTH} levels")
            if cls is None:
                return obj  # type: ignore[return-value]
        return msgspec.json.decode(raw, type=cls)
    except RecursionError:
        raise RequestError(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    except msgspec.ValidationError as exc:
        msg = str(exc)
        param = msg.rsplit(" - at `$.", 1)[1].rstrip("`") if " - at `$." in msg else None
        raise RequestError(f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error the application raises, answered as vLLM's JSON error body."""
    try:
        return await handler(request)
    except RequestError as exc:
        return json_error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = None
        if isinstance(exc, web.HTTPMethodNotAllowed):
            message = f"Method Not Allowed (allowed: {', '.join(sorted(exc.allowed_methods))})"
        return json_error(HTTPError(exc.status, message), {"Allow": exc.headers["Allow"]}
                          if "Allow" in exc.headers else None)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.rel_url.raw_path[:200])
        err = RequestError("Internal Server Error")
        err.status, err.type = 500, "InternalServerError"
        return json_error(err)
