"""kvlab.telemetry.span_export and .recorder: spans exported from a child process arrive exactly as the
SDK's own in-process BatchSpanProcessor sends them, whether the SDK's spans or kvlab's recorder made
them, and a dead export process never breaks the server.

Each case runs a fresh process (one TracerProvider per process) against a real OTLP/HTTP receiver
(the one of test_telemetry_env)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_telemetry_env import http_receiver  # noqa: F401  (fixture)

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`

PROBE = r"""
import json, multiprocessing, os, sys, time
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from kvlab.telemetry import genai
from kvlab.telemetry.setup import configure_tracing, shutdown_tracing

provider = configure_tracing("relay-probe", export_process=True)
tracer = trace.get_tracer("relay.probe", "1.2")
remote = propagate.extract({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
if sys.argv[1] == "kill":
    for child in multiprocessing.active_children():
        child.kill(); child.join()
if sys.argv[1] == "sigterm":   # what a stack's SIGTERM to the server's process group does to the child
    provider.force_flush(10_000)   # answered from the child's loop: past its start-up
    for child in multiprocessing.active_children():
        os.kill(child.pid, 15)
with tracer.start_as_current_span("root", context=remote, kind=SpanKind.SERVER,
                                  attributes={"s": "x", "i": 7, "f": 0.5, "b": True, "l": [1, 2]}) as root:
    root.set_attribute("late", "y")
    root.set_attribute("late.n", 7)
    root.set_attribute("late.l", (1.5, 2.5))
    root.set_attributes({"many.a": 1, "many.b": ["p", "q"], "none": None, "gen_ai.operation.name": "chat",
                          "gen_ai.request.model": "m"})
    root.update_name("root renamed")
    name, attrs = genai.call_of(root, "gateway.upstream", "http://replica:8000")   # reads the span back
    with tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attrs):
        pass
    with tracer.start_as_current_span("child", kind=SpanKind.CLIENT) as child:
        child.add_event("ev", {"k": "v", "n": 3})
        child.add_event("bare")
        child.set_status(Status(StatusCode.ERROR, "boom"))
        child.set_status(StatusCode.OK)
        child.set_status(StatusCode.ERROR, "after ok: ignored")
    with tracer.start_span("linked", links=[Link(root.get_span_context(), {"why": "test"})]):
        pass
    try:
        with tracer.start_as_current_span("raises"):
            raise ValueError("bad value")
    except ValueError:
        pass
    with tracer.start_as_current_span("recorded") as rec:
        rec.record_exception(KeyError("k"), {"extra": 1})
    root.set_status(StatusCode.OK)
root.set_attribute("after end", 1)
with tracer.start_as_current_span("orphan", context=Context()):   # no parent: the sampler's root decision
    pass
unsampled = propagate.extract({"traceparent": "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00"})
with tracer.start_as_current_span("not-sampled", context=unsampled):
    pass
flushed = provider.force_flush(10_000)
print(type(provider).__name__)
t = time.monotonic()
shutdown_tracing()
print(json.dumps({"flushed": flushed, "shutdown_s": time.monotonic() - t}))
"""


def run_probe(url: str, mode: str, export_process: str, expect: str | None = None, **otel: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env = {**base, **otel, "OTEL_EXPORTER_OTLP_ENDPOINT": url, "KVLAB_TRACES_EXPORT_PROCESS": export_process}
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    if expect:   # which provider made the spans
        assert expect in proc.stdout, proc.stdout
    return json.loads(proc.stdout.strip().splitlines()[-1])


def received_spans(got) -> list[tuple[str, dict, dict]]:
    """(scope, resource, span) of every span received, ids and times included, sorted by name."""
    out = []
    for r in got.requests:
        for rs in r["body"]["resourceSpans"]:
            resource = {kv["key"]: kv["value"] for kv in rs["resource"]["attributes"]
                        if kv["key"] != "service.instance.id"}   # a new one per process
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    out.append((json.dumps(ss["scope"], sort_keys=True), resource, span))
    return sorted(out, key=lambda x: (x[2]["name"], x[2]["kind"]))


@pytest.mark.parametrize(("setting", "provider", "sampler"), [
    ("sdk", "TracerProvider", "parentbased_always_on"),
    ("1", "RecorderProvider", "parentbased_always_on"),
    ("1", "RecorderProvider", "parentbased_traceidratio"),   # ratio 0: roots dropped, children follow the parent
])
def test_relay_exports_what_the_sdk_exports(http_receiver, setting, provider, sampler):  # noqa: F811
    url, got = http_receiver
    otel = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0"}
    out = run_probe(url, "normal", "0", "TracerProvider", **otel)
    assert out["flushed"]
    in_thread = received_spans(got)
    got.requests.clear()
    out = run_probe(url, "normal", setting, provider, **otel)
    assert out["flushed"]
    relayed = received_spans(got)
    names = ["chat m", "child", "linked", "orphan", "raises", "recorded", "root renamed"]
    if sampler == "parentbased_traceidratio":
        names.remove("orphan")
    assert [s["name"] for _, _, s in relayed] == names   # the unsampled one is not sent
    span = {s["name"]: s for _, _, s in relayed}
    root = span["root renamed"]
    assert root["traceId"] == "0af7651916cd43dd8448eb211c80319c" and root["parentSpanId"] == "b7ad6b7169203331"
    assert span["child"]["status"] == {"code": 1}   # OK is final
    assert span["linked"]["links"][0]["spanId"] == root["spanId"]
    assert span["raises"]["events"][0]["name"] == "exception"
    call = span["chat m"]   # named from root's operation and model, read back from the span
    assert {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}} in call["attributes"]

    def shape(spans):   # ids and times differ between the two runs; everything else must not
        keep = []
        for scope, resource, span in spans:
            span = {k: v for k, v in span.items() if k not in ("traceId", "spanId", "parentSpanId",
                                                                  "startTimeUnixNano", "endTimeUnixNano")}
            for ev in span.get("events", []):
                ev.pop("timeUnixNano")
                for kv in ev.get("attributes", []):
                    if kv["key"] == "exception.stacktrace":   # the frame of start_as_current_span differs
                        lines = kv["value"]["stringValue"].splitlines()
                        kv["value"] = [lines[0], lines[-1]]
            for link in span.get("links", []):
                link.pop("traceId"), link.pop("spanId")
            keep.append((scope, resource, span))
        return keep

    assert shape(relayed) == shape(in_thread)


def test_dead_export_process_never_breaks_the_server(http_receiver):  # noqa: F811
    url, got = http_receiver
    out = run_probe(url, "kill", "1")
    assert not out["flushed"] and out["shutdown_s"] < 10
    assert got.requests == []


def test_the_export_process_outlives_a_sigterm_to_deliver_the_last_spans(http_receiver):  # noqa: F811
    """A stack stops a server with SIGTERM to its whole process group: the export process must
    still take the spans the server sends as it shuts down (a run's last requests kept their traces)."""
    url, got = http_receiver
    out = run_probe(url, "sigterm", "1")
    assert out["flushed"]
    assert "root renamed" in [s["name"] for _, _, s in received_spans(got)]
