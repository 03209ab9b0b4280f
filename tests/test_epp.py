"""`kvlab epp` over real gRPC, driven the way Envoy's ext_proc filter drives it, against simulator replicas.

The test plays Envoy: it sends request headers and the body (in chunks, full-duplex streaming as
the standalone Envoy config sets), reads the picked endpoints, forwards the (possibly rewritten)
body itself to the first one over HTTP, then streams the replica's response headers and body back
through the EPP, as Envoy would.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port, sim_process

grpc = pytest.importorskip("grpc")
ext_proc = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode as Mode  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvlab.lifecycle import terminate  # noqa: E402
from kvlab.telemetry import names  # noqa: E402

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`

DEST = "x-gateway-destination-endpoint"


def _headers(items: dict[str, str], end: bool) -> ext_proc.HttpHeaders:
    return ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]),
        end_of_stream=end)


def _mutations(cr) -> dict[str, str]:
    return {h.header.key: (h.header.raw_value.decode() or h.header.value) for h in cr.header_mutation.set_headers}


class Stream:
    """One ext_proc bidirectional stream (one HTTP request through the proxy)."""

    def __init__(self, stub) -> None:
        self.q: queue.Queue = queue.Queue()
        self.replies = stub.Process(iter(self.q.get, None), timeout=30)

    def send(self, **kw) -> None:
        self.q.put(ext_proc.ProcessingRequest(**kw))

    def recv(self):
        return next(self.replies)

    def close(self) -> None:
        self.q.put(None)


class Envoy:
    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = ext_proc_grpc.ExternalProcessorStub(self.channel)

    def exchange(self, body: bytes | None, path: str = "/v1/chat/completions", chunks: int = 3,
                 extra: dict[str, str] | None = None, subset: list[str] | None = None,
                 forward: bool = True, mode: str = "FULL_DUPLEX_STREAMED") -> dict:
        """Request phase, forward to the first picked endpoint, response phase; what Envoy saw."""
        s = Stream(self.stub)
        md = base_pb2.Metadata()
        if subset is not None:
            hint = struct_pb2.Struct()
            hint.update({"x-gateway-destination-endpoint-subset": subset})
            md.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        cfg = ext_proc.ProtocolConfiguration(request_body_mode=Mode.BodySendMode.Value(mode),
                                             response_body_mode=Mode.BodySendMode.Value(mode))
        hdrs = {":method": "POST" if body is not None else "GET", ":path": path, ":authority": "gw",
                "content-type": "application/json", **(extra or {})}
        s.send(request_headers=_headers(hdrs, end=body is None), metadata_context=md, protocol_config=cfg)
        if body is not None:
            step = max(1, -(-len(body) // chunks))
            parts = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
            for i, part in enumerate(parts):
                s.send(request_body=ext_proc.HttpBody(body=part, end_of_stream=i == len(parts) - 1))
        first = s.recv()
        out: dict = {"first": first}
        if first.HasField("immediate_response"):
            s.close()
            ir = first.immediate_response
            out.update(status=ir.status.code, body=json.loads(ir.body))
            return out
        assert first.HasField("request_headers"), first
        out["upstream_headers"] = _mutations(first.request_headers.response)
        out["metadata"] = dict(first.dynamic_metadata.fields["envoy.lb"].struct_value.fields)
        sent = body or b""
        if body is not None:
            rb = s.recv()
            assert rb.HasField("request_body"), rb
            sent = rb.request_body.response.body_mutation.streamed_response.body
        out["sent"] = sent
        if not forward:
            s.close()
            return out
        endpoint = out["upstream_headers"][DEST].split(",")[0]
        fwd = {k: v for k, v in out["upstream_headers"].items() if k in ("traceparent",)}
        req = urllib.request.Request(f"http://{endpoint}{path}", data=sent if body is not None else None,
                                     headers={"Content-Type": "application/json", **fwd})
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, ctype, payload = resp.status, resp.headers["Content-Type"], resp.read()
        served = base_pb2.Metadata()
        served.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": endpoint})
        s.send(response_headers=_headers({":status": str(status), "content-type": ctype}, end=False),
               metadata_context=served)
        rh = s.recv()
        out["client_headers"] = _mutations(rh.response_headers.response)
        got = b""
        step = max(1, len(payload) // 4)
        parts = [payload[i:i + step] for i in range(0, len(payload), step)]
        for i, part in enumerate(parts):
            s.send(response_body=ext_proc.HttpBody(body=part, end_of_stream=i == len(parts) - 1))
            got += s.recv().response_body.response.body_mutation.streamed_response.body
        s.close()
        out.update(status=status, endpoint=endpoint, client_body=got)
        return out


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def epp(tmp_path_factory) -> Iterator[tuple[Envoy, dict, str]]:
    tmp: Path = tmp_path_factory.mktemp("epp")
    with sim_process(tmp, "--replicas", "3", "--time-scale", "0.05") as (_, sims):
        (tmp / "engines.json").write_text(json.dumps(sims))
        port, mport = free_port(), free_port()
        ready = tmp / "epp.ready.json"
        proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "epp", "--port", str(port),
                                 "--metrics-port", str(mport), "--endpoints-file", str(tmp / "engines.json"),
                                 "--policy", "kv-aware", "--scrape-interval-ms", "100",
                                 "--ready-file", str(ready)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "epp did not become ready"
                time.sleep(0.05)
            yield Envoy(f"127.0.0.1:{port}"), sims, f"http://127.0.0.1:{mport}"
            assert proc.poll() is None, "the EPP died during the tests"
        finally:
            terminate(proc, 15)


def _chat(doc: str, question: str, stream: bool = False) -> bytes:
    return json.dumps({"model": "kvlab-tiny", "max_tokens": 4, "stream": stream,
                       "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]}).encode()


def _doc(k: int) -> str:
    return "\n".join(f"Manual {k} section {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][(i * k + j) % 4]
                                                            for j in range(12)) for i in range(40))


def test_health_service_answers(epp):
    envoy, _, _ = epp
    stub = health_pb2_grpc.HealthStub(envoy.channel)
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        for _ in range(50):
            st = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            if st == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.1)
        assert st == health_pb2.HealthCheckResponse.SERVING, service


def test_picked_endpoint_holds_the_prefix_with_ranked_fallbacks(epp):
    envoy, sims, url = epp
    addrs = {r["url"].split("://")[1] for r in sims["replicas"]}
    first = envoy.exchange(_chat(_doc(1), "first question"))
    assert first["status"] == 200
    ranked = first["upstream_headers"][DEST].split(",")
    # the header and the envoy.lb metadata carry the same ranked list: chosen first, fallbacks after
    assert first["metadata"][DEST].string_value == first["upstream_headers"][DEST]
    assert len(ranked) >= 2 and len(set(ranked)) == len(ranked) and set(ranked) <= addrs
    assert first["client_headers"][names.HEADER_ROUTED_TO]
    time.sleep(0.5)       # the replica's BlockStored events reach the index
    again = envoy.exchange(_chat(_doc(1), "second question"))
    assert again["endpoint"] == first["endpoint"], "the same prefix went elsewhere"
    body = json.loads(again["client_body"])
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(again["client_headers"][names.HEADER_PREFIX_PREDICTED]) > 0
    # the delivered part of the decomposition was read from the forwarded response body
    assert 'kind="delivered"' in _scrape(url)


def test_streamed_request_usage_read_and_dropped_again(epp):
    envoy, _, url = epp
    out = envoy.exchange(_chat(_doc(2), "stream it", stream=True), chunks=5)
    assert out["status"] == 200
    assert json.loads(out["sent"])["stream_options"] == {"include_usage": True}
    assert out["upstream_headers"]["content-length"] == str(len(out["sent"]))
    events = [e for e in out["client_body"].split(b"\n\n") if e.startswith(b"data: {")]
    assert events and not any(json.loads(e[6:]).get("usage") and not json.loads(e[6:])["choices"] for e in events)
    assert out["client_body"].rstrip().endswith(b"data: [DONE]")


def test_trace_continues_from_traceparent(epp):
    envoy, _, _ = epp
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    out = envoy.exchange(_chat(_doc(3), "traced"), extra={"traceparent": parent}, forward=False)
    tp = out["upstream_headers"]["traceparent"]
    assert tp.split("-")[1] == "0af7651916cd43dd8448eb211c80319c" and tp.split("-")[2] != "b7ad6b7169203331"


@pytest.mark.parametrize(("body", "status"), [
    (b'{"model": "kvlab-tiny", "messages": [', 400),                  # malformed JSON
    (b"[1, 2]", 400),                                                  # not an object
    (b'{"model": "kvlab-tiny", "messages": "hi", "stream": "yes"}', 400),
    (b'{"model": "kvlab-tiny", "messages": 5}', 400),                   # no prompt the tokenizer can read
    (b"{}", 400),                                                      # no messages at all
    (None, 400),                                                       # headers end the request: no body
])
def test_bad_body_gets_an_immediate_error(epp, body, status):
    envoy, _, _ = epp
    out = envoy.exchange(body)
    assert out["status"] == status
    assert out["body"]["error"]["code"] == status and out["body"]["error"]["message"]
    assert envoy.exchange(_chat(_doc(4), "still serving"), forward=False)["upstream_headers"][DEST]


def test_subset_hint_is_obeyed_and_empty_subset_is_503(epp):
    envoy, sims, _ = epp
    only = sims["replicas"][2]["url"].split("://")[1]
    out = envoy.exchange(_chat(_doc(1), "restricted"), subset=[only], forward=False)
    assert out["upstream_headers"][DEST] == only
    assert envoy.exchange(_chat(_doc(1), "nowhere"), subset=["10.255.255.1:1"])["status"] == 503


def test_bodyless_get_routed_on_load(epp):
    envoy, sims, _ = epp
    out = envoy.exchange(None, path="/v1/models", forward=False)
    assert out["upstream_headers"][DEST].split(",")[0] in {r["url"].split("://")[1] for r in sims["replicas"]}


def _open(envoy: Envoy, mode: int) -> tuple[Stream, object]:
    """A POST /v1/completions stream in body `mode`: its request headers sent, the first answer read."""
    s = Stream(envoy.stub)
    cfg = ext_proc.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode)
    s.send(request_headers=_headers({":method": "POST", ":path": "/v1/completions"}, end=False), protocol_config=cfg)
    return s, s.recv()


def test_buffered_mode_answers_headers_at_once_and_routes_with_the_body(epp):
    envoy, sims, _ = epp
    s, first = _open(envoy, Mode.BUFFERED)
    assert first.HasField("request_headers") and not _mutations(first.request_headers.response)
    s.send(request_body=ext_proc.HttpBody(body=json.dumps({"model": "kvlab-tiny", "prompt": _doc(5),
                                                           "max_tokens": 2}).encode(), end_of_stream=True))
    body = s.recv()
    assert body.HasField("request_body")
    picked = _mutations(body.request_body.response)[DEST].split(",")[0]
    assert picked in {r["url"].split("://")[1] for r in sims["replicas"]}
    assert body.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value.startswith(picked)
    s.close()


def test_unroutable_body_mode_is_a_clear_503(epp):
    envoy, _, _ = epp
    s, out = _open(envoy, Mode.STREAMED)
    s.close()
    assert out.immediate_response.status.code == 503
    assert b"FULL_DUPLEX_STREAMED" in out.immediate_response.body
