"""In-process tests of a simulator replica's HTTP API: spans, Prometheus exposition, streaming."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from conftest import span_role
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing

MODEL = "kvlab-tiny"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


def run_with_replica(fn, *flags: str):
    """Start one replica in this process, run `fn(session, replica)`, stop it."""
    async def main():
        args = parser().parse_args(["--time-scale", "0.05", "--no-kv-events", *flags])
        (replica,), _ = build_replicas(args)
        await replica.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession(base_url=replica.url) as session:
                return await fn(session, replica)
        finally:
            await replica.stop()
    return asyncio.run(main())


def test_span_tree_attributes_and_incoming_trace_context(exporter):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    prompt = "alpha beta gamma delta " * 20

    async def fn(session, replica):
        for _ in range(2):
            async with session.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                                    headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}) as r:
                assert r.status == 200
                await r.json()

    exporter.clear()
    run_with_replica(fn)
    spans = [s for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]
    roots = [s for s in spans if span_role(s) == names.SPAN_ENGINE_REQUEST]
    assert len(roots) == 2
    for root in roots:
        assert root.kind == trace.SpanKind.SERVER
        assert format(root.parent.span_id, "016x") == parent_id
        assert root.attributes[names.REPLICA] == "sim"  # a single replica is named --name
        assert root.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
        children = {s.name: s for s in spans if s.parent and s.parent.span_id == root.context.span_id}
        assert set(children) == {names.SPAN_ENGINE_QUEUE, names.SPAN_ENGINE_PREFILL, names.SPAN_ENGINE_DECODE}
        q, p, d = (children[n] for n in (names.SPAN_ENGINE_QUEUE, names.SPAN_ENGINE_PREFILL, names.SPAN_ENGINE_DECODE))
        assert root.start_time <= q.start_time <= q.end_time <= p.start_time <= p.end_time <= d.start_time <= d.end_time <= root.end_time
        pa = p.attributes
        assert pa[names.ENGINE_CACHED_TOKENS] + pa[names.ENGINE_COMPUTED_TOKENS] == pa[names.PROMPT_TOKENS]
    first, second = sorted(roots, key=lambda s: s.start_time)
    assert first.attributes[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 0
    assert second.attributes[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] > 0
    for s in spans:  # no prompt or completion text anywhere
        assert not any("alpha" in str(v) for v in s.attributes.values())


def test_prometheus_exposition_parses_with_vllm_names():
    async def fn(session, replica):
        for _ in range(2):
            async with session.post("/v1/completions", json={"prompt": list(range(100, 190)), "max_tokens": 3}) as r:
                assert r.status == 200
        async with session.get("/metrics") as r:
            return await r.text()

    text = run_with_replica(fn, "--num-blocks", "500", "--block-size", "8", "--max-model-len", "4000")
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    info = samples[names.VLLM_CACHE_CONFIG_INFO][0]
    assert info.labels["block_size"] == "8" and info.labels["num_gpu_blocks"] == "500"
    q = samples[names.VLLM_PREFIX_CACHE_QUERIES + "_total"][0]
    h = samples[names.VLLM_PREFIX_CACHE_HITS + "_total"][0]
    assert q.labels["model_name"] == MODEL
    assert q.value == 2 * 90 and 0 < h.value < 90          # tokens, second request hit
    assert samples[names.VLLM_TTFT + "_count"][0].value == 2
    assert samples[names.VLLM_ITL + "_count"][0].value == 4   # 2 gaps per 3-token request
    assert samples[names.VLLM_E2E + "_count"][0].value == 2
    assert samples[names.VLLM_QUEUE_TIME + "_count"][0].value == 2
    for name in (names.VLLM_NUM_REQUESTS_RUNNING, names.VLLM_NUM_REQUESTS_WAITING, names.VLLM_KV_CACHE_USAGE):
        assert samples[name][0].value == 0


def test_stop_strings_min_tokens_and_seed():
    async def fn(session, replica):
        async def text(**kw):
            async with session.post("/v1/completions", json={"prompt": "x y z", **kw}) as r:
                return await r.json()
        full = await text(max_tokens=12, seed=5)
        words = full["choices"][0]["text"].split(" ")
        stop = " " + words[4]                       # 4th generated word (text starts with a space)
        cut = await text(max_tokens=12, seed=5, stop=stop)
        late = await text(max_tokens=12, seed=5, stop=stop, min_tokens=12)
        other = await text(max_tokens=12, seed=6)
        return full, cut, late, other, stop

    full, cut, late, other, stop = run_with_replica(fn)
    t = full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 12 and full["choices"][0]["finish_reason"] == "length"
    first = t.find(stop)
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["text"] == t[:first]
    assert late["choices"][0]["text"] == t      # min_tokens suppresses the stop
    assert other["choices"][0]["text"] != t


def test_stream_chunks_one_token_each_and_usage_last():
    async def fn(session, replica):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post("/v1/chat/completions", json=body) as r:
            assert r.headers[names.HEADER_REPLICA] == "sim"
            return (await r.read()).decode()

    raw = run_with_replica(fn)
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 5 and all(c["choices"][0]["delta"]["content"].strip() for c in tokens)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_client_disconnect_aborts_and_frees_blocks():
    async def fn(session, replica):
        async with session.post("/v1/completions", json={"prompt": "a b c " * 40, "max_tokens": 2000, "stream": True}) as r:
            await r.content.readline()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if replica.engine.scheduler.pool.num_free == replica.cfg.num_blocks:
                break
        return replica.engine.scheduler.pool.num_free, replica.cfg.num_blocks, len(replica.engine.scheduler.running)

    free, total, running = run_with_replica(fn)
    assert free == total and running == 0
