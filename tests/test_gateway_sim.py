"""The gateway against real `kvlab engine sim` replicas (subprocesses, free ports, killed by pid).

- kv-aware keeps each shared-prefix group on one replica, the busiest replica serves at most
  1.5x the mean, and delivered/predicted >= 0.9 once warm;
- round-robin still computes available/predicted in shadow and leaves cache on the table;
- spans: one trace id from the client through the gateway to the replica's engine span; a client
  that goes away (waiting for the replica's headers, or mid-stream) ends the gateway's request and
  upstream spans as errors of type client_disconnected, never as finished requests;
- failures: a replica killed mid-run: streaming requests on it end with an error event, requests
  not yet streaming are retried and succeed, the gateway keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import free_port, span_role
from kvlab.contract import Endpoint
from kvlab.gateway.config import load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
from kvlab.gateway.server import Gateway
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing

pytestmark = pytest.mark.slow
KVLAB = [sys.executable, "-m", "kvlab.cli"]
_TOK = PromptTokenizer()


class OtlpReceiver:
    """Collects (trace_id, span_id, parent_span_id, name) from OTLP/HTTP protobuf posts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            receiver.spans.append({"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                                   "parent": s.parent_span_id.hex(), "name": s.name,
                                                   "role": next((a.value.string_value for a in s.attributes
                                                                 if a.key == names.SPAN_ROLE), s.name)})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def start_sim(tmp: Path, name: str, replicas: int, otlp: str,
              time_scale: float = 0.1) -> tuple[subprocess.Popen, list[Endpoint]]:
    ready = tmp / f"{name}.ready.json"
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_SERVICE_NAME": name}
    proc = subprocess.Popen([*KVLAB, "engine", "sim", "--replicas", str(replicas), "--name", name,
                             "--time-scale", str(time_scale), "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 40
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sim did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    return proc, [Endpoint(**r) for r in json.loads(ready.read_text())["replicas"]]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def otlp():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    configure_tracing("kvlab-gateway-test", extra=SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def sims(tmp_path_factory, otlp):
    """Three replicas, one process each, so one can be killed alone."""
    tmp = tmp_path_factory.mktemp("sims")
    procs, eps = [], []
    try:
        for i in range(3):
            p, e = start_sim(tmp, f"s{i}", 1, otlp.url)
            procs.append(p)
            eps += e
        yield procs, eps
    finally:
        for p in procs:
            stop(p)


class InProcessGateway:
    def __init__(self, policy: str, endpoints: list[Endpoint], tokens=None) -> None:
        self.cfg = load_policy(policy)
        self.gw = Gateway(self.cfg, StaticDiscovery(endpoints), tokens or _TOK, scrape_interval_ms=100)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def __aenter__(self):
        self.runner = self.gw.runner()    # the server settings `kvlab gateway` runs with
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        await self.gw.ready.wait()
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        # wait for the first scrape and for every event stream to be live
        for _ in range(100):
            reps = self.gw.registry.replicas.values()
            if all(r.last_scrape for r in reps):
                break
            await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.runner.cleanup()

    async def reset(self, endpoints: list[Endpoint]) -> None:
        for e in endpoints:
            async with self.client.post(e.url + "/reset_prefix_cache") as r:
                assert r.status == 200

    async def chat(self, system: str, user: str, stream: bool = False, max_tokens: int = 4, headers=None):
        payload = {"model": "kvlab-tiny", "max_tokens": max_tokens, "stream": stream,
                   "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        async with self.client.post(self.url + "/v1/chat/completions", json=payload, headers=headers or {}) as r:
            return r.status, dict(r.headers), await r.read()


def doc(group: int, lines: int = 50) -> str:
    rng = random.Random(group)
    return "\n".join(f"Section {group}.{i}: " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa"])
                                                        for _ in range(10)) for i in range(lines))


def cached(body: bytes) -> int:
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_kv_aware_keeps_groups_balances_and_delivers(sims):
    procs, eps = sims

    async def go():
        async with InProcessGateway("kv-aware", eps) as g:
            await g.reset(eps)
            await asyncio.sleep(0.3)
            assert all(r.events_state in ("live", "connecting") for r in g.gw.registry.replicas.values())
            groups = 6
            where: dict[int, Counter] = defaultdict(Counter)
            per_replica: Counter = Counter()
            pred_sum = deliv_sum = 0
            # warm-up: every group's first request arrives at once
            first = await asyncio.gather(*(g.chat(doc(k), "hello") for k in range(groups)))
            for k, (st, hdr, body) in enumerate(first):
                assert st == 200, body
                where[k][hdr[names.HEADER_ROUTED_TO]] += 1
                per_replica[hdr[names.HEADER_ROUTED_TO]] += 1
            rows: list[tuple] = []
            await asyncio.sleep(0.3)   # let the KV events of the warm-up arrive
            sem = asyncio.Semaphore(6)

            async def one(i: int):
                nonlocal pred_sum, deliv_sum
                k = i % groups        # equally popular groups
                async with sem:
                    st, hdr, body = await g.chat(doc(k), f"question {i}")
                assert st == 200, body
                where[k][hdr[names.HEADER_ROUTED_TO]] += 1
                per_replica[hdr[names.HEADER_ROUTED_TO]] += 1
                pred_sum += int(hdr[names.HEADER_PREFIX_PREDICTED])
                deliv_sum += cached(body)
                rows.append((k, hdr[names.HEADER_ROUTED_TO], hdr[names.HEADER_PREFIX_PREDICTED], cached(body)))
                assert int(hdr[names.HEADER_PREFIX_AVAILABLE]) >= int(hdr[names.HEADER_PREFIX_PREDICTED])

            await asyncio.gather(*(one(i) for i in range(48)))
            assert all(len(c) == 1 for c in where.values()), dict(where)
            mean = sum(per_replica.values()) / 3
            assert max(per_replica.values()) <= 1.5 * mean, per_replica
            assert pred_sum > 0 and deliv_sum / pred_sum >= 0.9, (deliv_sum, pred_sum, rows)
            dbg = await (await g.client.get(g.url + "/debug/endpoints")).json()
            assert all(r["events"]["state"] == "live" and r["index"]["used"] == "precise" for r in dbg["replicas"])
            assert sum(r["index"]["precise_blocks"] for r in dbg["replicas"]) > groups * 10

    asyncio.run(asyncio.wait_for(go(), 120))


def test_round_robin_shadow_scores_show_what_was_left(sims):
    procs, eps = sims

    async def go():
        async with InProcessGateway("round-robin", eps) as g:
            await g.reset(eps)
            await asyncio.sleep(0.2)
            avail = pred = 0
            seen = set()
            for i in range(9):
                st, hdr, body = await g.chat(doc(100 + i % 4), f"q{i}")
                assert st == 200
                seen.add(hdr[names.HEADER_ROUTED_TO])
                await asyncio.sleep(0.05)
                if i >= 4:
                    avail += int(hdr[names.HEADER_PREFIX_AVAILABLE])
                    pred += int(hdr[names.HEADER_PREFIX_PREDICTED])
            assert len(seen) == 3
            assert avail > pred        # round robin left cache on the table, and we can see it
            assert avail > 0

    asyncio.run(asyncio.wait_for(go(), 60))


def test_spans_one_trace_from_client_to_replica(sims, spans, otlp):
    procs, eps = sims

    async def go():
        async with InProcessGateway("kv-aware", eps) as g:
            tracer = trace.get_tracer("test-client")
            with tracer.start_as_current_span(names.SPAN_CLIENT_REQUEST) as client_span:
                headers: dict[str, str] = {}
                propagate.inject(headers)
                st, hdr, body = await g.chat(doc(200), "trace me", stream=True, headers=headers)
            assert st == 200
            async with g.client.get(g.url + "/metrics",
                                    headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as r:
                exposition = await r.text()
            return format(client_span.get_span_context().trace_id, "032x"), exposition

    spans.clear()
    trace_id, exposition = asyncio.run(asyncio.wait_for(go(), 60))
    # the gateway's TTFT histogram links to this trace (an OpenMetrics exemplar)
    assert f'# {{trace_id="{trace_id}"}}' in exposition
    mine = {span_role(s): s for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id}
    assert {names.SPAN_GATEWAY_REQUEST, names.SPAN_SCHEDULE, names.SPAN_UPSTREAM} <= set(mine)
    req, sched, up = mine[names.SPAN_GATEWAY_REQUEST], mine[names.SPAN_SCHEDULE], mine[names.SPAN_UPSTREAM]
    assert req.kind == trace.SpanKind.SERVER and up.kind == trace.SpanKind.CLIENT
    assert req.parent.span_id == mine[names.SPAN_CLIENT_REQUEST].context.span_id
    for key in (names.PREFIX_AVAILABLE_TOKENS, names.PREFIX_PREDICTED_TOKENS, names.PREFIX_DELIVERED_TOKENS,
                names.REPLICA, names.PROMPT_TOKENS, names.POLICY, names.GEN_AI_REQUEST_MODEL):
        assert key in req.attributes, key
    for key in (names.SCHEDULE_CHOSEN, names.SCHEDULE_REASON, names.SCHEDULE_WEIGHTS, names.SCHEDULE_CANDIDATES,
                names.PREFIX_AVAILABLE_TOKENS, names.PREFIX_PREDICTED_TOKENS):
        assert key in sched.attributes, key
    cands = json.loads(sched.attributes[names.SCHEDULE_CANDIDATES])
    assert {c["replica"] for c in cands} == {e.name for e in eps}
    assert all(set(c["scores"]) == {"prefix", "queue", "kv_usage", "inflight", "inflight_tokens",
                                                "pending_prefill", "predicted_ttft"} for c in cands)
    assert json.loads(sched.attributes[names.SCHEDULE_WEIGHTS])["prefix"] > 0
    # no prompt text anywhere in the gateway's spans
    text = json.dumps([dict(s.attributes) for s in mine.values()])
    assert "Section" not in text and "trace me" not in text
    # the replica's engine span continues the same trace, as a child of the upstream CLIENT span
    deadline = time.monotonic() + 10
    engine = []
    while time.monotonic() < deadline and not engine:
        engine = [s for s in otlp.spans if s["trace_id"] == trace_id and s["role"] == names.SPAN_ENGINE_REQUEST]
        time.sleep(0.1)
    assert engine, "no engine span with the client's trace id"
    assert engine[0]["parent"] == format(up.context.span_id, "016x")


def test_kill_replica_mid_run(tmp_path, otlp):
    """The stream on the killed replica is resumed on another and ends cleanly; later requests are
    retried and succeed."""
    procs, eps = [], []
    try:
        for i in range(3):
            p, e = start_sim(tmp_path, f"k{i}", 1, otlp.url, time_scale=0.5)  # streams last seconds
            procs.append(p)
            eps += e

        async def go():
            async with InProcessGateway("round-robin", eps) as g:
                g.gw.registry.eject_after = 10_000   # never ejected: every pick of it must be retried
                victim = eps[1].name
                # long streams on every replica (round robin: one each)
                streams = [asyncio.create_task(g.chat(doc(300 + i), "long", stream=True, max_tokens=150))
                           for i in range(3)]
                await asyncio.sleep(0.8)
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].wait()
                # requests not yet streaming: those routed to the dead replica are retried and succeed
                res = await asyncio.gather(*(g.chat(doc(400 + i), "after", max_tokens=2) for i in range(9)))
                assert all(st == 200 for st, _, _ in res), [b for st, _, b in res if st != 200]
                assert all(hdr[names.HEADER_ROUTED_TO] != victim for _, hdr, _ in res)
                results = await asyncio.gather(*streams)
                broken = [(hdr, body) for st, hdr, body in results if hdr[names.HEADER_ROUTED_TO] == victim]
                assert len(broken) == 1
                assert all(b.rstrip().endswith(b"[DONE]") and b'"error"' not in b for _, _, b in results)
                events = [json.loads(e[6:]) for e in broken[0][1].decode().split("\n\n")
                          if e.startswith("data: {")]
                assert len({e["id"] for e in events}) == 1
                assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
                text = (await (await g.client.get(g.url + "/metrics")).read()).decode()
                retried = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith(names.KVLAB_RETRIES + "_total{"))
                assert retried >= 3
                assert f'{names.KVLAB_UPSTREAM_ERRORS}_total{{kind="stream",replica="{victim}"}}' in text
                assert f'{names.KVLAB_RESUMES}_total{{reason="stream"}} 1.0' in text
                assert f'{names.KVLAB_UPSTREAM_ERRORS}_total{{kind="connect",replica="{victim}"}}' in text
                assert (await g.client.get(g.url + "/health")).status == 200

        asyncio.run(asyncio.wait_for(go(), 90))
    finally:
        for p in procs:
            stop(p)


@pytest.mark.parametrize("when", ["before-headers", "mid-stream"])
def test_a_client_that_goes_away_ends_the_spans_as_disconnected(spans, when):
    """A replica that never finishes (before its headers, or after one streamed event); the client
    drops its request: the gateway's request span and its upstream call end as errors."""
    called = asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        called.set()
        if when == "mid-stream":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def go():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with InProcessGateway("round-robin", [Endpoint(name="slow", url=f"http://127.0.0.1:{port}")]) as g:
                tracer = trace.get_tracer("test-client")
                with tracer.start_as_current_span(names.SPAN_CLIENT_REQUEST) as client_span:
                    headers: dict[str, str] = {}
                    propagate.inject(headers)
                    req = asyncio.create_task(g.chat("x", "y", stream=True, max_tokens=50, headers=headers))
                    await asyncio.wait_for(called.wait(), 10)
                    if when == "mid-stream":
                        await asyncio.sleep(0.2)   # the event is relayed
                    req.cancel()
                    await asyncio.gather(req, return_exceptions=True)
                trace_id = client_span.get_span_context().trace_id
                for _ in range(200):   # the gateway's handler is cancelled once it sees the connection go
                    if any(span_role(s) == names.SPAN_GATEWAY_REQUEST and s.context.trace_id == trace_id
                           for s in spans.get_finished_spans()):
                        return trace_id
                    await asyncio.sleep(0.05)
                raise AssertionError("the gateway's request span never ended")
        finally:
            await runner.cleanup()

    spans.clear()
    trace_id = asyncio.run(asyncio.wait_for(go(), 60))
    mine = {span_role(s): s for s in spans.get_finished_spans() if s.context.trace_id == trace_id}
    for role in (names.SPAN_GATEWAY_REQUEST, names.SPAN_UPSTREAM):
        s = mine[role]
        assert s.status.status_code == trace.StatusCode.ERROR, (role, s.status)
        assert s.attributes.get(names.ERROR_TYPE) == "client_disconnected", (role, dict(s.attributes))
