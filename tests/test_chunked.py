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
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import free_port
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.gateway.chunked.slots import SlotQueue, class_rank
from kvlab.gateway.chunked.splice import resume_body
from kvlab.gateway.config import load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
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
