"""Chunked decoding (docs/chunked-decoding.md): the slot order, the simulator's side of a resumed
chunk, and the gateway stage against in-process simulator replicas.

- slots: a better class is served first, within a class the tenant with fewer slots, aging lifts a
  starving low-priority chunk, reserved slots stay free for the best class;
- simulator: a resumed chunk (chat with `continue_final_message`, completions with the text
  appended) tokenizes to prompt + generated ids, so it hashes to the blocks already cached: a hit,
  or a recompute after the cache was reset;
- gateway: a chunked stream is one valid SSE stream with the unchunked token count and usage; every
  chunk goes to the same replica and each resumed chunk is a cache hit (spans, metrics).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import free_port
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.gateway.chunked.slots import SlotQueue, class_rank
from kvlab.gateway.config import load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
from kvlab.gateway.resume import resume_body
from kvlab.gateway.server import Gateway
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing
from kvlab.tokenizer import Tokenizer

MODEL = "kvlab-tiny"
MESSAGES = [{"role": "user", "content": "tell me a long story about the house by the river " * 8}]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


# ---- the slot queue ------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _order(q: SlotQueue, entries: list[tuple[int, str]], clock: FakeClock | None = None,
           advance: float = 0.0) -> list[int]:
    """Hold the only slot, queue `entries` (rank, tenant), then release one at a time: the grant order."""
    async def main() -> list[int]:
        await q.acquire(0, "holder")
        order: list[int] = []

        async def one(i: int, rank: int, tenant: str) -> None:
            await q.acquire(rank, tenant)
            order.append(i)

        tasks = [asyncio.create_task(one(i, r, t)) for i, (r, t) in enumerate(entries)]
        await asyncio.sleep(0)
        if clock is not None:
            clock.now += advance
        for _ in entries:
            q.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order
    return asyncio.run(main())


def test_priority_then_tenant_fairness_then_arrival():
    assert class_rank("high") == 0 and class_rank("LOW") == 2 and class_rank(None) == 1
    assert class_rank("7") == 2 and class_rank("bogus") == 1
    q = SlotQueue(1, 0, aging_s=0)
    # low first in arrival, then normal, then two tenants' high chunks: a has 2, b has 1
    order = _order(q, [(2, "a"), (1, "a"), (0, "a"), (0, "a"), (0, "b")])
    assert order[:3] == [2, 4, 3]          # high first; tenant b's chunk before a's second
    assert order[3:] == [1, 0]             # then normal, then low


def test_aging_lifts_a_starving_chunk():
    clock = FakeClock()
    q = SlotQueue(1, 0, aging_s=1.0, clock=clock)
    # the low chunk waited 2.5 s when the slot frees: two classes of aging make it high
    order = _order(q, [(2, "a"), (0, "b")], clock, advance=2.5)
    assert order == [0, 1]
    order = _order(SlotQueue(1, 0, aging_s=0), [(2, "a"), (0, "b")])
    assert order == [1, 0]                 # without aging the late high chunk goes first


def test_reserved_slot_is_kept_for_the_best_class():
    async def main() -> tuple[str, str]:
        q = SlotQueue(2, 1, aging_s=0)
        _, first = await q.acquire(2, "batch")             # takes the unreserved slot
        low = asyncio.create_task(q.acquire(2, "batch"))   # must wait: only the reserved slot is free
        await asyncio.sleep(0)
        assert not low.done()
        _, high = await q.acquire(0, "chat")               # gets the reserved slot at once
        q.release()
        q.release()
        _, held = await low
        return first + "/" + high, held
    seen, held = asyncio.run(main())
    assert seen == "none/none"
    assert held == "reserved"


# ---- the simulator's side of a resumed chunk -----------------------------------------------------
def run_sim(fn, replicas: int = 1):
    async def main():
        args = parser().parse_args(["--time-scale", "0.02", "--no-kv-events", "--replicas", str(replicas)])
        reps, _ = build_replicas(args)
        for r in reps:
            await r.start("127.0.0.1", 0)
        try:
            return await fn(reps)
        finally:
            for r in reps:
                await r.stop()
    return asyncio.run(main())


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_resumed_chunk_tokenizes_to_prompt_plus_generated_and_hits_the_cache():
    tok = Tokenizer()

    async def fn(reps):
        (r,) = reps
        out = {}
        async with aiohttp.ClientSession() as s:
            chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "min_tokens": 40}
            a = await _post(s, r.url + "/v1/chat/completions", chat)
            text = a["choices"][0]["message"]["content"]
            resumed = resume_body(chat, "chat", text)
            b = await _post(s, r.url + "/v1/chat/completions", resumed)
            await s.post(r.url + "/reset_prefix_cache")
            c = await _post(s, r.url + "/v1/chat/completions", resumed)
            out["chat"] = (a["usage"], text, b["usage"], c["usage"])
            prompt = "the house by the river and the long road home " * 6
            comp = {"model": MODEL, "prompt": prompt, "max_tokens": 33, "min_tokens": 33}
            a = await _post(s, r.url + "/v1/completions", comp)
            b = await _post(s, r.url + "/v1/completions", resume_body(comp, "text_completion", a["choices"][0]["text"]))
            out["completion"] = (a["usage"], a["choices"][0]["text"], b["usage"])
        return out

    out = run_sim(fn)
    ua, text, ub, uc = out["chat"]
    assert len(tok.encode(text)) == ua["completion_tokens"] == 40
    assert ub["prompt_tokens"] == ua["prompt_tokens"] + 40        # the ids round-trip exactly
    block = 16
    assert ub["prompt_tokens_details"]["cached_tokens"] == (ub["prompt_tokens"] - 1) // block * block
    assert (uc["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0   # evicted: recomputed
    ua, text, ub = out["completion"]
    assert ub["prompt_tokens"] == ua["prompt_tokens"] + 33
    assert ub["prompt_tokens_details"]["cached_tokens"] == (ub["prompt_tokens"] - 1) // block * block


# ---- the gateway stage against simulator replicas ------------------------------------------------
def run_gateway(tmp_path, fn, policy: str = "kv-aware-chunked", replicas: int = 2):
    """In-process simulator replicas behind an in-process gateway with `policy`."""
    async def main(reps):
        cfg = tmp_path / "policy.yaml"
        cfg.write_text("health: {scrape_interval_ms: 60000}\n")
        gw = Gateway(load_policy(policy, cfg), StaticDiscovery([r.endpoint() for r in reps]), PromptTokenizer())
        runner = web.AppRunner(gw.app(), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await gw.ready.wait()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                return await fn(session, gw)
        finally:
            await runner.cleanup()
    return run_sim(main, replicas)


def parse_sse(raw: bytes) -> list[dict]:
    """The data events of an SSE body; asserts the framing (blank-line separated, `[DONE]` once, last)."""
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw[-200:]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert sum(e == "data: [DONE]" for e in events) == 1
    return [json.loads(e[6:]) for e in events[:-2]]


def test_chunked_stream_is_one_valid_stream_with_the_unchunked_count_and_usage(tmp_path, exporter):
    tok = Tokenizer()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "min_tokens": 100, "stream": True,
            "stream_options": {"include_usage": True}}

    async def fn(session, gw):
        out = {}
        async with session.post("/v1/chat/completions", json=body, headers={names.HEADER_CHUNK_TOKENS: "0"}) as r:
            out["plain"] = parse_sse(await r.read())
        exporter.clear()
        async with session.post("/v1/chat/completions", json=body, headers={names.HEADER_PRIORITY: "low"}) as r:
            assert r.status == 200
            out["replica"] = r.headers[names.HEADER_ROUTED_TO]
            out["chunked"] = parse_sse(await r.read())
        out["spans"] = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_CHUNK]
        unary = {**body, "stream": False}
        async with session.post("/v1/chat/completions", json=unary) as r:
            out["unary"] = await r.json()
        async with session.post("/v1/completions", json={"model": MODEL, "prompt": "the house by the river " * 20,
                                                          "max_tokens": 70, "min_tokens": 70}) as r:
            out["completion"] = await r.json()
        async with session.post("/v1/chat/completions", json=body, headers={names.HEADER_CHUNK_TOKENS: "x"}) as r:
            out["bad"] = (r.status, await r.json())
        async with session.get("/metrics") as r:
            out["metrics"] = await r.text()
        return out

    out = run_gateway(tmp_path, fn)
    plain, chunked = out["plain"], out["chunked"]
    # one id, the role once, a finish_reason only on the last choice event, usage last
    assert len({e["id"] for e in chunked}) == 1
    roles = [e for e in chunked if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1
    finishes = [e["choices"][0]["finish_reason"] for e in chunked if e["choices"]]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    usage = chunked[-1]["usage"]
    assert chunked[-1]["choices"] == []
    assert usage["completion_tokens"] == plain[-1]["usage"]["completion_tokens"] == 100
    assert usage["prompt_tokens"] == plain[-1]["usage"]["prompt_tokens"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunked if e["choices"])
    assert len(tok.encode(text)) == 100
    # 64-token chunks: 2 chunks, both on the routed replica, the resumed one a cache hit
    spans = sorted(out["spans"], key=lambda s: s.attributes[names.CHUNK_INDEX])
    assert [s.attributes[names.CHUNK_SIZE] for s in spans] == [64, 36]
    assert {s.attributes[names.REPLICA] for s in spans} == {out["replica"]}
    assert spans[1].attributes[names.CHUNK_RESUME_HIT] is True
    assert spans[1].attributes[names.CHUNK_CACHED_TOKENS] >= usage["prompt_tokens"] + 64 - 16
    assert all(s.attributes[names.CHUNK_PRIORITY] == "low" for s in spans)
    # non-streaming chat and completions: one answer with the whole text and summed usage
    u = out["unary"]
    assert u["usage"]["completion_tokens"] == 100 and u["choices"][0]["finish_reason"] == "length"
    assert len(tok.encode(u["choices"][0]["message"]["content"])) == 100
    c = out["completion"]
    assert c["usage"]["completion_tokens"] == 70 and len(tok.encode(c["choices"][0]["text"])) == 70
    assert out["bad"][0] == 400 and "x-kvlab-chunk-tokens" in out["bad"][1]["error"]["message"]
    m = out["metrics"]
    assert 'kvlab_gateway_chunks_total{priority="low"} 2.0' in m
    assert 'kvlab_gateway_chunk_resumes_total{outcome="hit"}' in m
    assert "kvlab_gateway_chunk_queue_seconds_bucket" in m


def test_a_long_generation_yields_its_slot_between_chunks(tmp_path, exporter):
    """One slot, nothing reserved: a short request arriving during a long generation runs between two of
    its chunks instead of after all of them."""
    async def fn(session, gw):
        q = gw.chunked.queue(next(iter(gw.registry.replicas.values())))
        q.slots, q.reserved = 1, 0
        long = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "min_tokens": 400}
        short = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 4}
        done: list[str] = []

        async def send(name, body, prio, size):
            async with session.post("/v1/chat/completions", json=body,
                                    headers={names.HEADER_PRIORITY: prio, names.HEADER_CHUNK_TOKENS: size}) as r:
                assert r.status == 200
                await r.read()
                done.append(name)

        exporter.clear()
        first = asyncio.create_task(send("long", long, "low", "8"))
        while not q.busy:
            await asyncio.sleep(0.001)
        await asyncio.gather(first, send("short", short, "high", "8"))
        spans = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_CHUNK]
        return done, spans

    done, spans = run_gateway(tmp_path, fn, replicas=1)
    assert done == ["short", "long"]
    reasons = {(s.attributes[names.CHUNK_PRIORITY], s.attributes[names.CHUNK_HOLD_REASON]) for s in spans}
    assert ("low", "none") in reasons and ("low", "slots-busy") in reasons, reasons
