"""The simulator's side of P/D disaggregation: vLLM's kv_transfer_params protocol, the KV pull
(transfer cost from the profile, blocks cached on the decode replica), the kv_transfer span."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import span_role
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.engine.sim.profile import get_profile
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing

MODEL = "kvlab-tiny"
PROMPT = list(range(1000, 1000 + 400))     # 400 token ids: 25 blocks of 16
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


def run_pd(fn, scale: str = "0.05"):
    """A prefill and a decode replica in this process; `fn(session, prefill, decode)`."""
    async def main():
        reps = []
        for role in ("prefill", "decode"):
            args = parser().parse_args(["--time-scale", scale, "--no-kv-events", "--role", role, "--name", role])
            (r,), _ = build_replicas(args)
            await r.start("127.0.0.1", 0)
            reps.append(r)
        try:
            async with aiohttp.ClientSession() as session:
                return await fn(session, *reps)
        finally:
            for r in reps:
                await r.stop()
    return asyncio.run(main())


async def post(session, url, body, headers=None):
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


def test_prefill_hands_over_and_decode_pulls_only_what_it_lacks(exporter):
    bs = 16

    async def fn(session, p, d):
        assert p.endpoint().role == "prefill" and d.endpoint().role == "decode"
        st, _, pre = await post(session, p.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                                 "stream": False, "kv_transfer_params": PREFILL_PARAMS})
        assert st == 200 and pre["usage"]["completion_tokens"] == 1
        kv = pre["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == "prefill" and kv["remote_port"] == int(p.url.rsplit(":", 1)[1])
        assert len(kv["remote_block_ids"]) == len(PROMPT) // bs
        # decode: nothing cached locally -> pulls every full block but the one holding the last token
        st, h, out = await post(session, d.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 5,
                                                 "kv_transfer_params": kv})
        assert st == 200 and out["usage"]["completion_tokens"] == 5
        pulled = int(h[names.HEADER_KV_TRANSFER_TOKENS])
        assert pulled == (len(PROMPT) - 1) // bs * bs
        # the pulled blocks are now prefix hits on the decode replica
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == pulled
        assert "kv_transfer_params" not in out
        # same prompt again: the decode replica has it all, pulls nothing
        st, h, out = await post(session, d.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                 "kv_transfer_params": kv})
        assert int(h[names.HEADER_KV_TRANSFER_TOKENS]) == 0
        # a longer prompt sharing the first 400 tokens: only the new full blocks travel
        longer = PROMPT + list(range(100, 100 + 160))
        st, _, pre2 = await post(session, p.url, {"model": MODEL, "prompt": longer, "max_tokens": 1,
                                                  "kv_transfer_params": PREFILL_PARAMS})
        st, h, out = await post(session, d.url, {"model": MODEL, "prompt": longer, "max_tokens": 2,
                                                 "kv_transfer_params": pre2["kv_transfer_params"]})
        assert int(h[names.HEADER_KV_TRANSFER_TOKENS]) == (len(longer) - 1) // bs * bs - len(PROMPT) // bs * bs
        return d

    exporter.clear()
    run_pd(fn)
    spans = exporter.get_finished_spans()
    xfers = [s for s in spans if s.name == names.SPAN_ENGINE_KV_TRANSFER]
    assert len(xfers) == 3
    first = min(xfers, key=lambda s: s.start_time)
    assert first.attributes[names.KV_TRANSFER_TOKENS] == 384
    assert first.attributes[names.KV_TRANSFER_LOCAL_TOKENS] == 0
    assert first.attributes[names.PD_PREFILL_REPLICA] == "prefill"
    roots = {s.context.span_id: s for s in spans if span_role(s) == names.SPAN_ENGINE_REQUEST}
    assert roots[first.parent.span_id].attributes[names.PD_ROLE] == "decode"
    assert {s.attributes.get(names.PD_ROLE) for s in roots.values()} == {"prefill", "decode"}


def test_transfer_cost_follows_the_profile():
    """A pull takes fixed + per-token time (scaled); it is far cheaper than recomputing."""
    prof = get_profile("cpu-tiny")
    scale = 0.5

    async def fn(session, p, d):
        _, _, pre = await post(session, p.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                                "kv_transfer_params": PREFILL_PARAMS})
        _, h, _ = await post(session, d.url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                              "kv_transfer_params": pre["kv_transfer_params"]})
        return int(h[names.HEADER_KV_TRANSFER_TOKENS]), float(h[names.HEADER_KV_TRANSFER_MS])

    tokens, ms = run_pd(fn, scale=str(scale))
    expected = prof.transfer_ms(tokens) * scale
    assert expected <= ms < expected + 50      # sleeping never ends early; generous upper bound
    assert prof.transfer_ms(tokens) < tokens * prof.prefill_ms_per_token / 4


def test_bad_kv_transfer_params_are_400():
    async def fn(session, p, d):
        out = []
        for kv in ({"do_remote_prefill": True},                                  # no block ids
                   {"do_remote_prefill": True, "do_remote_decode": True, "remote_block_ids": []},
                   {"do_remote_decode": "yes"}):
            st, _, body = await post(session, d.url, {"model": MODEL, "prompt": PROMPT, "kv_transfer_params": kv})
            out.append((st, body["error"]["param"]))
        return out

    for st, param in run_pd(fn):
        assert st == 400 and param.startswith("kv_transfer_params")
