"""kvlab.telemetry.setup honours the standard OTEL_* variables: propagators, sampler and its arg,
resource attributes and service name, exporter choice, protocol, endpoint, headers and timeout.

Each case runs a fresh process (one TracerProvider per process) that configures tracing the way
kvlab's servers do, makes a span and injects its context; real OTLP receivers (HTTP and gRPC)
record what arrives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from conftest import FakeHandler, http_server
from kvlab.telemetry.sink import parse_traces, to_otlp_json

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`

PROBE = r"""
import json, sys, time
from opentelemetry import baggage, context, propagate, trace
from kvlab.telemetry.setup import configure_tracing, shutdown_tracing

configure_tracing("probe-default")
tracer = trace.get_tracer("probe")
carrier = {}
token = context.attach(baggage.set_baggage("k", "v"))
with tracer.start_as_current_span("probe.root") as span:
    propagate.inject(carrier)
    sampled = span.get_span_context().trace_flags.sampled
context.detach(token)
start = time.monotonic()
shutdown_tracing()
print(json.dumps({"carrier": carrier, "sampled": sampled, "shutdown_s": time.monotonic() - start}))
"""


def probe(env: dict[str, str], timeout: float = 60) -> dict:
    """Run PROBE with exactly these OTEL_* variables (the test's own are dropped)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stdout"], out["stderr"] = proc.stdout, proc.stderr
    return out


class Received:
    def __init__(self) -> None:
        self.requests: list[dict] = []   # {path, headers, body (OTLP JSON)}

    def services(self) -> list[str]:
        return [kv["value"]["stringValue"] for r in self.requests for rs in r["body"]["resourceSpans"]
                for kv in rs["resource"]["attributes"] if kv["key"] == "service.name"]

    def resource(self) -> dict[str, str]:
        rs = self.requests[0]["body"]["resourceSpans"][0]
        return {kv["key"]: next(iter(kv["value"].values())) for kv in rs["resource"]["attributes"]}

    def span_names(self) -> list[str]:
        return [s["name"] for r in self.requests for rs in r["body"]["resourceSpans"]
                for ss in rs["scopeSpans"] for s in ss["spans"]]


@pytest.fixture
def http_receiver():
    """An OTLP/HTTP receiver on a free port; POSTs to /stall are answered after 8 s."""
    got = Received()

    class Handler(FakeHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            got.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                 "body": to_otlp_json(parse_traces(body, self.headers.get("Content-Type", "")))})
            if self.path.startswith("/stall"):
                time.sleep(8)
            self.reply(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                       "application/x-protobuf")

    with http_server(Handler) as url:
        yield url, got


@pytest.fixture
def grpc_receiver():
    got = Received()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.requests.append({"path": "grpc", "headers": dict(context.invocation_metadata()),
                                 "body": to_otlp_json(request)})
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", got
    finally:
        server.stop(0)


def test_defaults_export_otlp_http_with_w3c_propagation(http_receiver):
    url, got = http_receiver
    out = probe({"OTEL_EXPORTER_OTLP_ENDPOINT": url})
    assert out["sampled"] and set(out["carrier"]) == {"traceparent", "baggage"}
    assert [r["path"] for r in got.requests] == ["/v1/traces"]
    assert got.services() == ["probe-default"] and got.span_names() == ["probe.root"]


def test_no_endpoint_exports_nothing_but_context_propagates(http_receiver):
    _, got = http_receiver
    out = probe({})
    assert out["sampled"] and "traceparent" in out["carrier"] and got.requests == []


@pytest.mark.parametrize("propagators, headers", [
    ("tracecontext", {"traceparent"}),
    ("baggage", {"baggage"}),
    ("none", set()),
])
def test_otel_propagators(propagators, headers):
    assert set(probe({"OTEL_PROPAGATORS": propagators})["carrier"]) == headers


@pytest.mark.parametrize("sampler, arg, sampled", [
    ("always_off", None, False),
    ("traceidratio", "0", False),
    ("parentbased_traceidratio", "1", True),
    ("parentbased_traceidratio", "0", False),
])
def test_otel_traces_sampler(http_receiver, sampler, arg, sampled):
    url, got = http_receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_TRACES_SAMPLER": sampler}
    if arg is not None:
        env["OTEL_TRACES_SAMPLER_ARG"] = arg
    out = probe(env)
    assert out["sampled"] is sampled
    assert bool(got.requests) is sampled
    assert bool(int(out["carrier"]["traceparent"][-2:], 16) & 1) is sampled   # the decision travels


def test_resource_attributes_and_service_name_override_the_default(http_receiver):
    url, got = http_receiver
    probe({"OTEL_EXPORTER_OTLP_ENDPOINT": url,
           "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment.name=lab,k8s.pod.name=p-0"})
    resource = got.resource()
    assert resource["service.name"] == "from-attrs"
    assert (resource["deployment.environment.name"], resource["k8s.pod.name"]) == ("lab", "p-0")
    got.requests.clear()
    probe({"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_SERVICE_NAME": "from-service-name",
           "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs"})
    assert got.services() == ["from-service-name"]        # OTEL_SERVICE_NAME wins, as specified


def test_traces_endpoint_and_headers(http_receiver):
    url, got = http_receiver
    probe({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",      # the signal-specific one wins
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{url}/custom/traces",   # used as is, no /v1/traces
           "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t0ken,x-tenant=lab"})
    assert [r["path"] for r in got.requests] == ["/custom/traces"]
    headers = got.requests[0]["headers"]
    assert (headers["authorization"], headers["x-tenant"]) == ("Bearer t0ken", "lab")


def test_exporter_timeout_bounds_a_stalled_backend(http_receiver):
    """The receiver answers after 8 s; with a 1 s timeout the process still exits promptly."""
    url, got = http_receiver
    out = probe({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{url}/stall", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    assert got.requests and out["shutdown_s"] < 5.0


def test_grpc_protocol(grpc_receiver):
    url, got = grpc_receiver
    probe({"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=lab"})
    assert got.services() == ["probe-default"] and got.requests[0]["headers"]["x-tenant"] == "lab"


def test_traces_exporter_none_and_console(http_receiver):
    url, got = http_receiver
    out = probe({"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_TRACES_EXPORTER": "none"})
    assert got.requests == [] and "traceparent" in out["carrier"]
    out = probe({"OTEL_TRACES_EXPORTER": "console,otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": url})
    assert '"name": "probe.root"' in out["stdout"] and got.span_names() == ["probe.root"]


@pytest.mark.parametrize("env", [
    {"OTEL_TRACES_EXPORTER": "no-such-exporter"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},                 # nothing listens
    {"OTEL_TRACES_SAMPLER": "bogus"},
])
def test_bad_settings_never_break_the_process(env):
    out = probe(env)
    assert "traceparent" in out["carrier"]
