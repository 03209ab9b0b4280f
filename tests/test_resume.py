"""A replica that dies mid-generation: the gateway resumes the request on another replica from
what the client already received (gateway/resume.py, docs/reliability.md).

The fake replicas stream one word per event, each word naming the replica and its position
(` fake-1:3`), and record every request: the client's text is checked token for token against
what each replica streamed before it died and what the next one generated from the text it was
sent back (no gap, no repeat).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvlab.gateway.resume import Progress, unresumable
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing
from test_gateway import _TOK, FakeReplica, Harness, run


class Deaths:
    """How many of the next served requests die, and after how many tokens."""

    def __init__(self, left: int, after: int = 3) -> None:
        self.left, self.after = left, after


class DyingReplica(FakeReplica):
    """Streams ` name:i` words (one per event, chat deltas or completion text) up to max_tokens,
    with a finish reason and usage; dies after `deaths.after` tokens while `deaths.left` > 0."""

    def __init__(self, name: str, deaths: Deaths) -> None:
        super().__init__(name)
        self.deaths = deaths
        self.sent: list[str] = []     # the words streamed per request, for the continuity check

    def _prompt_tokens(self, payload: dict) -> int:
        if "messages" in payload:
            return len(_TOK.encode_chat(payload["messages"])[0])
        return len(_TOK.encode_text(payload["prompt"])[0])

    async def complete(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.requests.append(payload)
        chat = "messages" in payload
        n = payload.get("max_tokens") or 16
        die = self.deaths.left > 0
        if die:
            self.deaths.left -= 1
        words = [f" {self.name}:{i}" for i in range(n)]
        prompt = self._prompt_tokens(payload)
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        ident = {"id": f"cmpl-{self.name}-{len(self.requests)}", "created": 1000 + len(self.requests),
                 "object": "chat.completion.chunk" if chat else "text_completion", "model": "m"}
        if not payload.get("stream"):
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            body = json.dumps({**ident, "choices": [choice], "usage": usage}).encode()
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            await resp.prepare(request)
            if die:   # headers and half the body, then the replica is gone
                await resp.write(body[: len(body) // 2])
                await asyncio.sleep(0.01)
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(body)
            await resp.write_eof()
            self.sent.append("".join(words))
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = ""
        if chat:
            await resp.write(b"data: " + json.dumps({**ident, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}).encode() + b"\n\n")
        for i, w in enumerate(words):
            if die and i == self.deaths.after:
                self.sent.append(sent)
                await asyncio.sleep(0.01)
                assert request.transport is not None
                request.transport.close()   # the replica dies mid-stream
                return resp
            last = i == n - 1
            ch = ({"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w})
            ch["finish_reason"] = "length" if last else None
            await resp.write(b"data: " + json.dumps({**ident, "choices": [ch]}).encode() + b"\n\n")
            sent += w
            await asyncio.sleep(0.002)
        self.sent.append(sent)
        if (payload.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + json.dumps({**ident, "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


def harness(deaths: Deaths, n: int = 3, **limits: int) -> Harness:
    h = Harness("least-load", n=n)
    h.replicas = [DyingReplica(f"fake-{i}", deaths) for i in range(n)]
    if limits:
        from kvlab.gateway.config import Limits
        h.cfg_over = {"limits": Limits(**limits)}
    return h


def events(body: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for e in body.decode().split("\n\n"):
        if e.startswith("data: "):
            out.append("[DONE]" if e == "data: [DONE]" else json.loads(e[6:]))
    return out


def streamed_text(evs: list[dict | str]) -> str:
    text = ""
    for e in evs:
        if isinstance(e, dict):
            for ch in e.get("choices") or []:
                text += (ch["delta"].get("content") or "") if "delta" in ch else ch.get("text") or ""
    return text


def served(h: Harness) -> list[DyingReplica]:
    """The replicas that took part, in the order they served (by the words of the client's text)."""
    return [r for r in h.replicas if r.requests]  # type: ignore[misc]


async def metric(h: Harness, prefix: str) -> float:
    text = (await (await h.client.get(h.url + "/metrics")).read()).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def check_one_stream(evs: list[dict | str], chat: bool) -> None:
    """One id and created, the role delta once, exactly one finish reason, one [DONE] at the end."""
    dicts = [e for e in evs if isinstance(e, dict)]
    assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
    assert not any("error" in e for e in dicts), dicts
    assert len({(e["id"], e["created"]) for e in dicts}) == 1
    finishes = [ch["finish_reason"] for e in dicts for ch in e.get("choices") or [] if ch.get("finish_reason")]
    assert finishes == ["length"]
    if chat:
        assert sum(1 for e in dicts for ch in e.get("choices") or [] if "role" in ch.get("delta", {})) == 1


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_resumed_mid_way_is_one_stream_without_gap_or_repeat(chat, exporter):
    async def go():
        deaths = Deaths(1, after=3)
        async with harness(deaths) as h:
            exporter.clear()
            req = {"model": "m", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
            req |= ({"messages": [{"role": "user", "content": "tell me a story"}]} if chat
                    else {"prompt": "once upon a time"})
            st, hdr, body = await h.post("/v1/chat/completions" if chat else "/v1/completions", req)
            assert st == 200
            evs = events(body)
            check_one_stream(evs, chat)
            first, second = sorted(served(h), key=lambda r: len(r.requests[0].get("messages", [])) +
                                   len(r.requests[0].get("prompt", "")))
            assert first.name == hdr[names.HEADER_ROUTED_TO]
            lost = first.sent[0]
            assert lost.count(":") == 3                 # three tokens reached the client from the first
            resumed = second.requests[0]
            assert resumed["max_tokens"] == 5           # the rest of max_tokens
            if chat:
                assert resumed["messages"][-1] == {"role": "assistant", "content": lost}
                assert resumed["continue_final_message"] is True and resumed["add_generation_prompt"] is False
            else:
                assert resumed["prompt"] == "once upon a time" + lost
            # token for token: what the first sent, then what the second generated; nothing else
            assert streamed_text(evs) == lost + second.sent[0]
            assert len(streamed_text(evs).split()) == 8
            usage = [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")]
            assert len(usage) == 1
            original = (len(_TOK.encode_chat(req["messages"])[0]) if chat else len(_TOK.encode_text(req["prompt"])[0]))
            assert usage[0]["prompt_tokens"] == original
            assert usage[0]["completion_tokens"] == 8
            assert usage[0]["total_tokens"] == original + 8
            assert await metric(h, names.KVLAB_RESUMES + '_total{reason="stream"}') == 1
            spans = [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
            ev = [e for s in spans for e in s.events if e.name == names.EVENT_RESUME]
            assert len(ev) == 1
            a = ev[0].attributes
            assert a[names.RESUME_FROM] == first.name and a[names.REPLICA] == second.name
            assert a[names.RESUME_TOKENS_SENT] == 3 and a[names.RESUME_PREFILL_TOKENS] > 0
    run(go())


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_unstreamed_request_whose_replica_dies_is_answered_by_another(chat):
    async def go():
        async with harness(Deaths(1)) as h:
            req = {"model": "m", "max_tokens": 6}
            req |= ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"})
            st, _, body = await h.post("/v1/chat/completions" if chat else "/v1/completions", req)
            assert st == 200, body
            obj = json.loads(body)
            ch = obj["choices"][0]
            text = ch["message"]["content"] if chat else ch["text"]
            winner = [r for r in served(h) if r.sent]
            assert len(winner) == 1 and text == winner[0].sent[0]   # nothing was received: sent again whole
            assert obj["usage"]["completion_tokens"] == 6
            assert await metric(h, names.KVLAB_RESUMES + '_total{reason="body"}') == 1
    run(go())


def test_a_generation_whose_replicas_die_twice_is_still_one_stream():
    async def go():
        async with harness(Deaths(2, after=2)) as h:
            st, _, body = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 7, "stream": True,
                                                           "stream_options": {"include_usage": True}})
            assert st == 200
            evs = events(body)
            check_one_stream(evs, False)
            order = sorted(served(h), key=lambda r: len(r.requests[0]["prompt"]))
            assert [len(r.requests[0]["prompt"]) > 1 for r in order] == [False, True, True]
            assert [r.requests[0]["max_tokens"] for r in order] == [7, 5, 3]
            assert streamed_text(evs) == "".join(r.sent[0] for r in order)
            assert order[2].requests[0]["prompt"] == "p" + order[0].sent[0] + order[1].sent[0]
            usage = next(e["usage"] for e in evs if isinstance(e, dict) and e.get("usage"))
            assert usage["completion_tokens"] == 7 == len(streamed_text(evs).split())
    run(go())


def test_resume_cap_ends_in_a_clear_error_not_a_silent_truncation():
    async def go():
        async with harness(Deaths(2, after=2), max_resumes=1) as h:
            st, _, body = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 7, "stream": True})
            assert st == 200
            evs = events(body)
            assert evs[-1] == "[DONE]"
            err = evs[-2]["error"]
            assert "not resumed: 1 resumes already" in err["message"] and err["code"] == 502
            assert len(streamed_text(evs).split()) == 4       # what two replicas sent before they died
    run(go())


def test_all_replicas_dead_is_a_503_in_openai_shape_not_a_hang():
    async def go():
        async with harness(Deaths(2, after=2), n=2) as h:
            st, _, body = await asyncio.wait_for(h.post("/v1/completions", {"prompt": "p", "max_tokens": 7,
                                                                             "stream": True}), 10)
            evs = events(body)
            assert evs[-1] == "[DONE]"
            err = evs[-2]["error"]
            assert err["code"] == 503 and "no healthy replica left" in err["message"]
            for r in h.replicas:
                await r.stop()
            st, _, body = await asyncio.wait_for(h.post("/v1/completions", {"prompt": "q", "max_tokens": 3}), 10)
            assert st == 503
            err = json.loads(body)["error"]
            assert err["type"] == "UpstreamError" and err["code"] == 503
    run(go())


def test_a_request_that_cannot_be_continued_says_why():
    async def go():
        async with harness(Deaths(1, after=2)) as h:
            st, _, body = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 7, "stream": True,
                                                           "logprobs": 1})
            evs = events(body)
            assert "not resumed: logprobs" in evs[-2]["error"]["message"]
    run(go())


def test_unresumable_and_usage_arithmetic():
    assert unresumable({"prompt": "x", "n": 2}, "text_completion")
    assert unresumable({"prompt": [1, 2]}, "text_completion")
    assert unresumable({"messages": [], "top_logprobs": 2}, "chat")
    assert unresumable({"messages": [], "n": 1}, "chat") is None
    from kvlab.contract import Usage
    p = Progress(prompt_tokens=10, resumes=1, carried=4)
    u = p.usage_json(Usage(prompt_tokens=14, completion_tokens=3))
    assert u == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}


def test_the_index_forgets_an_ejected_replica_and_learns_it_again():
    async def go():
        h = Harness("kv-aware", n=2)
        async with h:
            h.gw.registry.readmit_after_s = 0.3
            doc = " ".join(f"shared line {i} of the document." for i in range(40))
            for i in range(4):
                st, _, _ = await h.post("/v1/completions", {"prompt": doc + f" q{i}", "max_tokens": 2})
                assert st == 200
            learned = {r.name: h.gw.approx.blocks(r.name) for r in h.replicas}
            dead = max(learned, key=lambda n: learned[n])
            assert learned[dead] > 0
            victim = next(r for r in h.replicas if r.name == dead)
            await victim.stop()
            for i in range(6):
                st, hdr, _ = await h.post("/v1/completions", {"prompt": doc + f" again {i}", "max_tokens": 2})
                assert st == 200 and hdr[names.HEADER_ROUTED_TO] != dead
            assert not h.gw.registry.replicas[dead].healthy
            assert h.gw.approx.blocks(dead) == 0          # forgotten at once: nothing attracts routing there
            await victim.start()
            for _ in range(50):
                if h.gw.registry.replicas[dead].healthy:
                    break
                await asyncio.sleep(0.1)
            assert h.gw.registry.replicas[dead].healthy
            routed = []
            for i in range(30):       # new prompts go by load: until one lands on the readmitted replica
                _, hdr, _ = await h.post("/v1/completions", {"prompt": f"fresh {i} " * 20, "max_tokens": 2})
                routed.append(hdr[names.HEADER_ROUTED_TO])
                if routed[-1] == dead:
                    break
            assert routed[-1] == dead, routed                 # it gets traffic again
            assert h.gw.approx.blocks(dead) > 0            # learned again from the requests routed to it
    run(go())


def test_traces_explain_says_the_resume_in_words():
    from kvlab.traces.explain import resumes
    from kvlab.traces.span import Span, SpanEvent, Trace
    ev = SpanEvent(names.EVENT_RESUME, 2, {names.RESUME_INDEX: 1, names.RESUME_FROM: "sim-0",
                                           names.RESUME_REASON: "stream", names.RESUME_TOKENS_SENT: 12,
                                           names.REPLICA: "sim-1", names.RESUME_PREFILL_TOKENS: 40})
    span = Span("a" * 32, "b" * 16, None, names.SPAN_GATEWAY_REQUEST, "kvlab-gateway", "server", 1, 3, events=(ev,))
    (line,) = resumes(Trace("a" * 32, [span]))
    assert "sim-0 failed (stream) after 12 tokens" in line and "sim-1 continued" in line and "40" in line
    early = SpanEvent(names.EVENT_RESUME, 2, {**ev.attributes, names.RESUME_TOKENS_SENT: 0})
    (line,) = resumes(Trace("a" * 32, [dataclasses.replace(span, events=(early,))]))
    assert "before any token reached the client; sim-1 served it from the start" in line and "continued" not in line


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_chunked_generation_whose_replica_dies_continues_on_another(chat, exporter):
    """Chunks of 4 tokens; the first replica dies 3 tokens into its first chunk: the next chunks run on
    another replica from what the client had, and the client still sees one stream of 10 tokens."""
    from kvlab.gateway.chunked.settings import ChunkedSettings

    async def go():
        h = harness(Deaths(1, after=3))
        h.cfg_over = {"chunked": ChunkedSettings(chunk_tokens=4)}
        async with h:
            exporter.clear()
            req = {"model": "m", "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
            req |= ({"messages": [{"role": "user", "content": "tell me a story"}]} if chat
                    else {"prompt": "once upon a time"})
            st, hdr, body = await h.post("/v1/chat/completions" if chat else "/v1/completions", req)
            assert st == 200, body
            evs = events(body)
            check_one_stream(evs, chat)
            [first] = [r for r in served(h) if r.name == hdr[names.HEADER_ROUTED_TO]]
            [second] = [r for r in served(h) if r is not first]
            lost = first.sent[0]
            assert lost.count(":") == 3 and len(first.requests) == 1
            # the second replica continued chunk by chunk: 4 then 3 tokens, each from the text so far
            assert [b["max_tokens"] for b in second.requests] == [4, 3]
            resumed = second.requests[0]
            if chat:
                assert resumed["messages"][-1] == {"role": "assistant", "content": lost}
            else:
                assert resumed["prompt"] == "once upon a time" + lost
            assert streamed_text(evs) == lost + "".join(second.sent)
            assert len(streamed_text(evs).split()) == 10
            [usage] = [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")]
            original = (len(_TOK.encode_chat(req["messages"])[0]) if chat else len(_TOK.encode_text(req["prompt"])[0]))
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (original, 10)
            assert await metric(h, names.KVLAB_RESUMES + '_total{reason="stream"}') == 1
            spans = [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
            [ev] = [e for s in spans for e in s.events if e.name == names.EVENT_RESUME]
            assert ev.attributes[names.RESUME_FROM] == first.name and ev.attributes[names.REPLICA] == second.name
    run(go())
