"""A simulated replica with a CPU tier, over HTTP: a prompt evicted from GPU comes back from CPU
(cached_tokens, vLLM's external prefix-cache metrics, the engine.prefill span's tier attributes);
and the gateway's cross-replica pull hint (`x-kvlab-kv-pull`) priced like a P/D pull."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing

MODEL = "kvlab-tiny"
A = list(range(100, 100 + 400))      # 25 blocks of 16 (the tiny vocabulary has 2,048 ids)
B = list(range(1500, 1500 + 400))


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


def run(fn, *flags: str):
    async def main():
        args = parser().parse_args(["--time-scale", "0.05", "--no-kv-events", "--num-blocks", "30",
                                    "--max-model-len", "480", *flags])
        (r,), _ = build_replicas(args)
        await r.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                return await fn(session, r)
        finally:
            await r.stop()
    return asyncio.run(main())


async def post(session, url, prompt, headers=None):
    async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                            headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


async def metric(session, url, name):
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_prompt_evicted_from_gpu_is_loaded_back_from_cpu(exporter):
    async def fn(session, r):
        await post(session, r.url, A)
        await post(session, r.url, B)            # 30 GPU blocks: B evicts all but A's first 4 from GPU
        _, _, out = await post(session, r.url, A)
        hits = await metric(session, r.url, names.VLLM_EXTERNAL_PREFIX_CACHE_HITS + "_total")
        gpu_hits = await metric(session, r.url, names.VLLM_PREFIX_CACHE_HITS + "_total")
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], hits, gpu_hits

    exporter.clear()
    cached, hits, gpu_hits = run(fn, "--cpu-kv-blocks", "200")
    assert cached == 384 and hits == 320 and gpu_hits == 64
    prefills = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_ENGINE_PREFILL]
    last = max(prefills, key=lambda s: s.start_time)
    assert last.attributes[names.ENGINE_CPU_HIT_TOKENS] == 320
    assert last.attributes[names.ENGINE_KV_LOAD_MS] == pytest.approx(20 * 0.2 * 0.05)


def test_without_the_tier_the_evicted_prompt_is_recomputed():
    async def fn(session, r):
        await post(session, r.url, A)
        await post(session, r.url, B)
        _, _, out = await post(session, r.url, A)
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert run(fn) == 64


def test_pull_hint_pulls_the_prefix_at_the_transfer_cost_and_bad_hints_are_400():
    async def fn(session, r):
        st, h, out = await post(session, r.url, A, {names.HEADER_KV_PULL: "sim-9;320"})
        bad = [await post(session, r.url, B, {names.HEADER_KV_PULL: v}) for v in ("sim-9", ";5", "x;-1")]
        return st, h, out, bad

    st, h, out, bad = run(fn)
    assert st == 200 and int(h[names.HEADER_KV_TRANSFER_TOKENS]) == 320
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
    assert all(b[0] == 400 and b[2]["error"]["param"] == names.HEADER_KV_PULL for b in bad)


def test_the_tiered_topology_gives_the_engine_its_cpu_tier(tmp_path):
    from pathlib import Path

    from kvlab.stack.local import engine_argv
    from kvlab.topology import load_topology

    topo = load_topology(Path(__file__).resolve().parents[1] / "labs" / "topologies" / "tiered.yaml")
    argv = engine_argv(topo, topo.pools[0], "sim", tmp_path / "ready.json", tmp_path)
    assert argv[argv.index("--cpu-kv-blocks") + 1] == "500"
    sim_args = argv[argv.index("sim") + 1:]
    (r, *_), _ = build_replicas(parser().parse_args([*sim_args, "--no-kv-events"]))
    assert r.engine.scheduler.pool.tier is not None and r.engine.scheduler.pool.tier.num_blocks == 500
