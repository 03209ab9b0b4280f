"""A small OTLP/HTTP trace receiver that stores spans as OTLP JSON lines (no Jaeger needed).

`python -m kvlab.telemetry.sink --host 127.0.0.1 --port P --out DIR [--ready-file F]`

It answers like an OpenTelemetry collector: `POST /v1/traces` with `application/x-protobuf` or
`application/json` bodies (gzip accepted), one canonical OTLP/JSON `ExportTraceServiceRequest`
per line in `DIR/traces-<start>-<pid>.jsonl`, flushed after every request so readers see spans
at once. Trace and span ids are hex strings and enums integers, as the OTLP/JSON spec says.
`/v1/metrics` and `/v1/logs` are accepted and dropped. A payload that does not parse gets a
400, never a crash.

The local stack decides between this sink, a Jaeger it starts, and an endpoint it was given with
`choose_trace_target` (see docs/observability.md).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvlab.lifecycle import announce_ready, free_port, run, stop_requested

log = logging.getLogger("kvlab.telemetry.sink")

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MAX_BODY = 64 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.Response]]

# ---------------------------------------------------------------------------------------------
# OTLP/JSON <-> protobuf JSON mapping: ids are hex in OTLP/JSON, base64 in protobuf's JSON.


def _map_ids(request: dict[str, Any], convert: Callable[[str], str]) -> dict[str, Any]:
    for rs in request.get("resourceSpans") or []:
        for ss in rs.get("scopeSpans") or []:
            for span in ss.get("spans") or []:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = convert(span[key])
                for link in span.get("links") or []:
                    for key in ("traceId", "spanId"):
                        if link.get(key):
                            link[key] = convert(link[key])
    return request


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode()


def to_otlp_json(message: ExportTraceServiceRequest) -> dict[str, Any]:
    """The canonical OTLP/JSON form of a request (hex ids, integer enums, camelCase keys)."""
    as_dict = json_format.MessageToDict(message, use_integers_for_enums=True)
    return _map_ids(as_dict, _b64_to_hex)


def parse_traces(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    """Parse an OTLP trace export body; ValueError when it is not one."""
    message = ExportTraceServiceRequest()
    if content_type.startswith(JSON):
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise ValueError("an OTLP/JSON body must be an object")
            json_format.ParseDict(_map_ids(data, _hex_to_b64), message, ignore_unknown_fields=True)
        except (json.JSONDecodeError, json_format.ParseError, ValueError, TypeError) as exc:
            raise ValueError(f"bad OTLP/JSON trace payload: {exc}") from exc
    else:
        try:
            message.ParseFromString(body)
        except DecodeError as exc:
            raise ValueError(f"bad OTLP/protobuf trace payload: {exc}") from exc
    return message


# ---------------------------------------------------------------------------------------------
# the server


class SpanFile:
    """Appends one OTLP/JSON line per export and flushes it immediately."""

    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = out_dir / f"traces-{stamp}-{os.getpid()}.jsonl"
        self._fh = self.path.open("a", encoding="utf-8")
        self.spans = 0

    def write(self, message: ExportTraceServiceRequest) -> int:
        n = sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)
        if n:
            self._fh.write(json.dumps(to_otlp_json(message), separators=(",", ":")) + "\n")
            self._fh.flush()
            self.spans += n
        return n

    def close(self) -> None:
        self._fh.close()


def _body_type(request: web.Request) -> str:
    ctype = (request.headers.get("Content-Type") or PROTOBUF).split(";")[0].strip().lower()
    return JSON if ctype == JSON else PROTOBUF


async def _read(request: web.Request) -> bytes:
    body = await request.read()
    if body[:2] == b"\x1f\x8b":  # gzip the server did not already undo
        body = gzip.decompress(body)
    return body


def _reply(ctype: str, response: Message) -> web.Response:
    if ctype == JSON:
        return web.Response(body=json_format.MessageToJson(response).encode(), content_type=JSON)
    return web.Response(body=response.SerializeToString(), content_type=PROTOBUF)


def _bad_request(message: str) -> web.Response:
    # OTLP/HTTP answers failures with a google.rpc.Status; its JSON form is enough for clients
    payload = json.dumps({"code": 3, "message": message})
    return web.Response(status=400, text=payload, content_type=JSON)


def make_app(out_dir: Path) -> web.Application:
    """The receiver as an aiohttp app (tests mount it in-process)."""
    spans = SpanFile(out_dir)

    async def traces(request: web.Request) -> web.Response:
        ctype = _body_type(request)
        try:
            message = parse_traces(await _read(request), ctype)
        except (ValueError, OSError, EOFError) as exc:
            log.warning("rejected trace export: %s", exc)
            return _bad_request(str(exc))
        spans.write(message)
        return _reply(ctype, ExportTraceServiceResponse())

    def dropping(response_type: type[Message]) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return _reply(_body_type(request), response_type())
        return handler

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "file": str(spans.path), "spans": spans.spans})

    async def close(_: web.Application) -> None:
        spans.close()

    app = web.Application(client_max_size=MAX_BODY)
    app["spans"] = spans
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/metrics", dropping(ExportMetricsServiceResponse))
    app.router.add_post("/v1/logs", dropping(ExportLogsServiceResponse))
    app.router.add_get("/health", health)
    app.on_cleanup.append(close)
    return app


async def serve(host: str, port: int, out_dir: Path, ready_file: Path | None) -> None:
    runner = web.AppRunner(make_app(out_dir), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    announce_ready({"otlp_endpoint": f"http://{host}:{bound}", "traces_dir": str(out_dir), "pid": os.getpid()},
                   ready_file)
    await stop_requested()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.telemetry.sink", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318, help="0 picks a free port (printed on ready)")
    parser.add_argument("--out", required=True, type=Path, help="directory for the *.jsonl span files")
    parser.add_argument("--ready-file", type=Path, help="written atomically once listening")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(serve(args.host, args.port, args.out, args.ready_file))
    except OSError as exc:
        print(f"kvlab sink: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# where the local stack sends spans

TraceKind = Literal["off", "files", "jaeger", "endpoint"]


@dataclass(frozen=True)
class TraceTarget:
    """Where a stack's processes send spans, and what (if anything) the stack must start for it.

    - `otlp_endpoint`: the value for every child's OTEL_EXPORTER_OTLP_ENDPOINT (None: tracing off);
    - `traces_dir`: where span files land (kind "files"), for stack.json's `traces_dir`;
    - `query_url`: a Jaeger query API/UI base URL (kind "jaeger"), for `kvlab traces --jaeger`;
    - `argv`: the process to start (sink or Jaeger), None when nothing must be started;
    - `ready_url`: GET it until 200 to know the backend listens;
    - `config_file`: a generated Jaeger config, written by `write_config` before the start.
    """

    kind: TraceKind
    otlp_endpoint: str | None = None
    traces_dir: Path | None = None
    query_url: str | None = None
    argv: list[str] | None = None
    ready_url: str | None = None
    config_file: Path | None = None
    config_text: str | None = field(default=None, repr=False)

    def write_config(self) -> None:
        """Write the generated config, if any, where `argv` expects it."""
        if self.config_file is not None and self.config_text is not None:
            self.config_file.parent.mkdir(parents=True, exist_ok=True)
            self.config_file.write_text(self.config_text)


def _jaeger_config(host: str, otlp_http: int, otlp_grpc: int, query_http: int, query_grpc: int,
                   health: int) -> str:
    """A config for Jaeger v2 (2.x, OTel-Collector based; see kvlab.traces.sources.jaeger for the
    query API we read): OTLP in, memory storage, query API/UI; every port chosen free."""
    return f"""\
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: {host}:{health}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: {host}:{query_http}
    grpc:
      endpoint: {host}:{query_grpc}
receivers:
  otlp:
    protocols:
      http:
        endpoint: {host}:{otlp_http}
      grpc:
        endpoint: {host}:{otlp_grpc}
processors:
  batch:
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def choose_trace_target(setting: str, run_dir: Path, host: str = "127.0.0.1",
                        jaeger_binary: str | None = None) -> TraceTarget:
    """Decide where a local stack's spans go, from the topology's `observability.traces`.

    `setting`: "off" → no export; an http(s) URL → that OTLP/HTTP endpoint (e.g. a running Jaeger,
    nothing is started); "files" → this sink writing `run_dir/traces/`; "jaeger" → a Jaeger v2
    binary found on PATH (error if absent); "auto" → Jaeger if a `jaeger` binary is on PATH, else
    the sink. Ports are chosen free now; the stack starts the result (`kvlab.stack.local.start_trace_backend`).
    """
    setting = (setting or "auto").strip()
    run_dir = Path(run_dir)
    if setting == "off":
        return TraceTarget(kind="off")
    if setting.startswith(("http://", "https://")):
        return TraceTarget(kind="endpoint", otlp_endpoint=setting.rstrip("/"))
    if setting not in {"auto", "files", "jaeger"}:
        raise ValueError(f"observability.traces: expected auto, files, jaeger, off or an OTLP URL, got {setting!r}")
    jaeger = jaeger_binary or shutil.which("jaeger")
    if setting == "jaeger" and jaeger is None:
        raise ValueError("observability.traces: jaeger requested but no `jaeger` binary on PATH")
    if setting != "files" and jaeger is not None:
        ports = [free_port(host) for _ in range(5)]
        config = run_dir / "jaeger.yaml"
        return TraceTarget(
            kind="jaeger", otlp_endpoint=f"http://{host}:{ports[0]}", query_url=f"http://{host}:{ports[2]}",
            argv=[jaeger, "--config", str(config)], ready_url=f"http://{host}:{ports[2]}/api/v3/services",
            config_file=config, config_text=_jaeger_config(host, *ports))
    port = free_port(host)
    traces_dir = run_dir / "traces"
    return TraceTarget(
        kind="files", otlp_endpoint=f"http://{host}:{port}", traces_dir=traces_dir,
        argv=[sys.executable, "-m", "kvlab.telemetry.sink", "--host", host, "--port", str(port),
              "--out", str(traces_dir)],
        ready_url=f"http://{host}:{port}/health")


if __name__ == "__main__":
    sys.exit(main())
