"""The gateway's P/D disaggregation against in-process simulator replicas (one prefill, one decode):
long uncached prompts are split, cached or short ones are not; one trace spans gateway, prefill
and decode; a failing prefill replica falls back to unified serving with a span event."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from conftest import free_port, span_role
from kvlab.contract import Endpoint
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.gateway.config import PDSettings, load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
from kvlab.gateway.server import Gateway
from kvlab.gateway.split import SPLIT, UNIFIED, decide
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing

MODEL = "kvlab-tiny"
THRESHOLD = 128


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def test_decision_function():
    s = PDSettings(threshold_tokens=100)
    assert decide(s, 1000, 0, True) == (SPLIT, "uncached-above-threshold", 1000)
    assert decide(s, 1000, 950, True) == (UNIFIED, "cached-on-decode", 50)
    assert decide(s, 60, 0, True) == (UNIFIED, "short-prompt", 60)
    assert decide(s, 1000, 0, False) == (UNIFIED, "no-prefill-replica", 1000)
    assert decide(s, 1000, 900, True)[0] == SPLIT          # exactly the threshold splits


def run(tmp_path: Path, fn, dead_prefill: bool = False):
    """Sim replicas 'prefill' and 'decode' (or a dead prefill endpoint) behind an in-process gateway."""
    async def main():
        reps = []
        roles = ("decode",) if dead_prefill else ("prefill", "decode")
        for role in roles:
            args = parser().parse_args(["--time-scale", "0.05", "--no-kv-events", "--role", role, "--name", role])
            (r,), _ = build_replicas(args)
            await r.start("127.0.0.1", 0)
            reps.append(r)
        eps = [r.endpoint() for r in reps]
        if dead_prefill:
            eps.append(Endpoint(name="prefill", url=f"http://127.0.0.1:{free_port()}", role="prefill"))
        cfg_file = tmp_path / "pd.yaml"
        cfg_file.write_text(f"pd: {{threshold_tokens: {THRESHOLD}}}\nhealth: {{scrape_interval_ms: 60000}}\n")
        gw = Gateway(load_policy("kv-aware", cfg_file), StaticDiscovery(eps), PromptTokenizer())
        runner = web.AppRunner(gw.app(), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await gw.ready.wait()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                return await fn(session)
        finally:
            await runner.cleanup()
            for r in reps:
                await r.stop()
    return asyncio.run(main())


async def complete(session, prompt, stream=False, traceparent=None):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "min_tokens": 3, "stream": stream}
    headers = {"traceparent": traceparent} if traceparent else {}
    async with session.post("/v1/completions", json=body, headers=headers) as r:
        data = await r.read()
        return r.status, r.headers, data


def test_split_unified_and_one_trace(tmp_path, exporter):
    trace_id = "6e0c63257de34c92bf9efcd03927272e"
    long = ids(600, 1)

    async def fn(session):
        out = {}
        st, h, body = await complete(session, long, traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
        assert st == 200, body
        out["first"] = (h[names.HEADER_PD_DECISION], h.get(names.HEADER_PREFILLED_BY), h[names.HEADER_ROUTED_TO])
        out["pulled"] = int(h.get(names.HEADER_KV_TRANSFER_TOKENS, "0"))   # the decode replica's, passed through
        st, h, _ = await complete(session, long)                # cached on the decode replica now
        out["again"] = h[names.HEADER_PD_DECISION]
        st, h, _ = await complete(session, ids(60, 2))          # short
        out["short"] = h[names.HEADER_PD_DECISION]
        st, h, body = await complete(session, long + ids(300, 3), stream=True)   # new uncached tail
        assert st == 200 and body.rstrip().endswith(b"data: [DONE]")
        out["tail"] = h[names.HEADER_PD_DECISION]
        async with session.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": " ".join(["word"] * 400)}]}) as r:
            assert r.status == 200
            out["chat"] = r.headers[names.HEADER_PD_DECISION]
        async with session.get("/metrics") as r:
            out["metrics"] = await r.text()
        return out

    exporter.clear()
    out = run(tmp_path, fn)
    assert out["first"] == (SPLIT, "prefill", "decode")
    assert out["pulled"] >= 512       # the full blocks of the 600-token prompt came from the prefill replica
    assert out["again"] == UNIFIED and out["short"] == UNIFIED
    assert out["tail"] == SPLIT and out["chat"] == SPLIT
    m = out["metrics"]
    assert 'kvlab_gateway_pd_decisions_total{decision="split",reason="uncached-above-threshold"} 3.0' in m
    assert 'kvlab_gateway_pd_decisions_total{decision="unified",reason="cached-on-decode"} 1.0' in m
    assert 'kvlab_gateway_pd_decisions_total{decision="unified",reason="short-prompt"} 1.0' in m
    assert "kvlab_gateway_kv_transfer_seconds_count 3.0" in m

    spans = [s for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(span_role(s), []).append(s)
    (root,) = by_name[names.SPAN_GATEWAY_REQUEST]
    (dec,) = by_name[names.SPAN_PD_DECISION]
    (pcall,) = by_name[names.SPAN_PREFILL_CALL]
    (dcall,) = by_name[names.SPAN_DECODE_CALL]
    assert names.SPAN_UPSTREAM not in by_name
    assert dec.attributes[names.PD_DECISION] == SPLIT
    assert dec.attributes[names.PD_UNCACHED_TOKENS] == 600 and dec.attributes[names.PD_THRESHOLD] == THRESHOLD
    assert dec.attributes[names.PD_PREFILL_REPLICA] == "prefill"
    for s in (dec, pcall, dcall):
        assert s.parent.span_id == root.context.span_id
    assert pcall.end_time <= dcall.start_time
    engines = {s.attributes[names.PD_ROLE]: s for s in by_name[names.SPAN_ENGINE_REQUEST]}
    assert engines["prefill"].parent.span_id == pcall.context.span_id
    assert engines["decode"].parent.span_id == dcall.context.span_id
    (xfer,) = by_name[names.SPAN_ENGINE_KV_TRANSFER]
    assert xfer.parent.span_id == engines["decode"].context.span_id
    assert xfer.attributes[names.KV_TRANSFER_TOKENS] == (600 - 1) // 16 * 16
    assert dcall.attributes[names.KV_TRANSFER_TOKENS] == xfer.attributes[names.KV_TRANSFER_TOKENS]
    # llm-d's shape: the prefill pool's profile run under pick_disagg_profile, prepare_disaggregation,
    # and the P/D proxy's timings on the legs (true TTFT: the request's start to the decode call's)
    (prepare,) = by_name[names.SPAN_PD_PREPARE]
    assert prepare.attributes[names.LLMD_PD_USED] is True
    assert prepare.attributes[names.LLMD_PD_PREFILL_TARGET] == pcall.attributes[names.LLMD_PD_PREFILL_TARGET]
    profiles = {s.attributes[names.LLMD_PROFILE_NAME]: s for s in by_name[names.SPAN_SCHEDULE]}
    assert profiles[names.PROFILE_PREFILL].parent.span_id == dec.context.span_id
    assert profiles[names.PROFILE_DECODE].parent.span_id == root.context.span_id
    assert pcall.attributes[names.LLMD_PD_PREFILL_STATUS] == 200
    d = dcall.attributes
    assert d[names.LLMD_PD_PREFILL_MS] == pytest.approx(pcall.attributes[names.LLMD_PD_PREFILL_DURATION])
    assert d[names.LLMD_PD_TRUE_TTFT_MS] >= d[names.LLMD_PD_PREFILL_MS] > 0
    assert d[names.LLMD_PD_TRUE_TTFT_MS] == pytest.approx((dcall.start_time - root.start_time) / 1e6, abs=2.0)
    assert d[names.LLMD_PD_TOTAL_MS] >= d[names.LLMD_PD_TRUE_TTFT_MS] + d[names.LLMD_PD_DECODE_MS] - 1.0
    assert d[names.LLMD_PD_DECODE_MS] == d[names.LLMD_PD_DECODE_DURATION] > 0


def test_prefill_failure_falls_back_to_unified(tmp_path, exporter):
    async def fn(session):
        st, h, body = await complete(session, ids(500, 4))
        return st, h, body

    exporter.clear()
    st, h, body = run(tmp_path, fn, dead_prefill=True)
    assert st == 200, body
    assert h[names.HEADER_PD_DECISION] == "fallback" and h[names.HEADER_ROUTED_TO] == "decode"
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if span_role(s) == names.SPAN_GATEWAY_REQUEST]
    events = [e for e in root.events if e.name == names.EVENT_PD_FALLBACK]
    assert len(events) == 1 and events[0].attributes[names.PD_REASON] == "prefill-connect"
    assert root.attributes[names.PD_FALLBACK] is True
    (pcall,) = [s for s in spans if span_role(s) == names.SPAN_PREFILL_CALL]
    assert pcall.status.status_code == StatusCode.ERROR
    (engine,) = [s for s in spans if span_role(s) == names.SPAN_ENGINE_REQUEST]
    assert names.PD_ROLE not in engine.attributes          # an ordinary request on the decode replica
    assert not [s for s in spans if s.name == names.SPAN_ENGINE_KV_TRANSFER]
