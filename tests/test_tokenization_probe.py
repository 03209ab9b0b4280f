"""The tokenizer parity probe against real simulator replicas, and the simulator's own parity.

Two simulators: one with kvlab's tokenizer (what the gateway loads), one with a Llama-3-shaped
tokenizer from the zoo (BOS, another vocabulary): the probe must find the second one different,
say where, and route it with the approximate index while the first stays precise.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tokenizer_zoo
from conftest import sim_process, span_role
from kvlab.contract import Endpoint
from kvlab.gateway.enginetokens import EngineTokens
from kvlab.gateway.parity import CHAT, PROMPT, compare
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing
from kvlab.tokenizer import Tokenizer
from test_gateway_sim import InProcessGateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tokenizer_zoo.llama3(tmp_path_factory.mktemp("zoo") / "llama3")


@pytest.fixture(scope="module")
def sims(tmp_path_factory, llama_dir):
    with sim_process(tmp_path_factory.mktemp("same"), "--name", "same") as (_, same), \
            sim_process(tmp_path_factory.mktemp("other"), "--name", "other", "--tokenizer", str(llama_dir)) as (_, other):
        yield [Endpoint(**r) for r in same["replicas"] + other["replicas"]]


def test_compare_names_the_first_differing_position():
    v = compare("chat", [1, 2, 3, 4], [1, 2, 9, 4])
    assert (v.state, v.position, v.local, v.remote) == ("tokenizer-mismatch", 2, 3, 9)
    assert compare("completion", [5, 1, 2], [1, 2]).position == 0      # a missing BOS
    assert compare("completion", [1, 2], [1, 2, 3]).position == 2
    assert compare("chat", [1, 2], [1, 2]).state == "match"


def test_simulator_serves_the_models_tokenization_and_template(sims, llama_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(llama_dir))
    url = next(e.url for e in sims if e.name.startswith("other"))
    got = httpx.post(url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    assert got == ref(PROMPT)["input_ids"] and got[0] == ref.bos_token_id
    got = httpx.post(url + "/tokenize", json={"messages": CHAT}, timeout=30).json()["tokens"]
    text = ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert got == ref(text, add_special_tokens=False)["input_ids"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=30).json()
    assert r["usage"]["prompt_tokens"] == len(got)


def _gateway(endpoints: list[Endpoint], tokens: PromptTokenizer | EngineTokens | None = None) -> InProcessGateway:
    """An in-process kv-aware gateway (kvlab's default tokenizer unless told otherwise)."""
    return InProcessGateway("kv-aware", endpoints, tokens or PromptTokenizer())


async def _replicas(g: InProcessGateway, endpoints: list[Endpoint]) -> dict[str, dict]:
    """/debug/endpoints once every probe is done and every event stream is live."""
    for i in range(300):
        reps = {r["name"]: r for r in (await (await g.client.get(g.url + "/debug/endpoints")).json())["replicas"]}
        if all(r["tokenizer"]["state"] != "unchecked" and r["events"]["state"] == "live" for r in reps.values()):
            return reps
        if i % 10 == 0:   # an event stream goes live with its first stored block: give the replicas work
            for e in endpoints:
                await g.client.post(e.url + "/v1/completions", json={"prompt": f"warm up {i} " * 20, "max_tokens": 1})
        await asyncio.sleep(0.1)
    raise AssertionError(f"probes or event streams never finished: {reps}")


def test_probe_marks_a_mismatched_replica_and_routing_falls_back(sims, caplog):
    exporter = InMemorySpanExporter()
    configure_tracing("kvlab-gateway-test", extra=SimpleSpanProcessor(exporter))
    caplog.set_level(logging.INFO, logger="kvlab.gateway.parity")
    same_ep = next(e for e in sims if e.name.startswith("same"))
    other_ep = next(e for e in sims if e.name.startswith("other"))

    async def go():
        async with _gateway(sims) as g:
            reps = await _replicas(g, sims)
            same, other = reps[same_ep.name], reps[other_ep.name]
            assert same["tokenizer"]["state"] == "match", same
            assert other["tokenizer"]["state"] == "tokenizer-mismatch", other
            assert "differs at token 0" in other["tokenizer"]["detail"]       # the BOS the gateway lacks
            assert same["index"]["used"] == "precise"
            assert other["events"]["state"] == "live" and other["index"]["used"] == "approximate"
            health = await (await g.client.get(g.url + "/health")).json()
            assert health["tokenizer"] == {"source": "local", "mismatch": [other_ep.name]}
            metrics = await (await g.client.get(g.url + "/metrics")).text()
            assert f'{names.KVLAB_TOKENIZER_PARITY}{{replica="{other_ep.name}"}} 0.0' in metrics
            assert f'{names.KVLAB_TOKENIZER_PARITY}{{replica="{same_ep.name}"}} 1.0' in metrics
        # routing still works for it, on what the gateway learned from its own decisions
        async with _gateway([other_ep]) as g:
            await _replicas(g, [other_ep])
            doc = " ".join(f"shared line {i} about the probe." for i in range(60))
            for i in range(2):
                resp = await g.client.post(g.url + "/v1/completions", json={"prompt": doc + f" q{i}", "max_tokens": 2})
                assert resp.status == 200, await resp.text()
            assert int(resp.headers[names.HEADER_PREFIX_PREDICTED]) > 0
            body = await resp.json()
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    asyncio.run(asyncio.wait_for(go(), 120))
    lines = [r.getMessage() for r in caplog.records if "tokenizer mismatch" in r.getMessage()]
    assert len(lines) == 2 and all("completion sample differs at token 0" in m for m in lines), lines
    probes = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_TOKENIZER_PROBE]
    events = [e for s in probes for e in s.events if e.name == names.EVENT_TOKENIZER_MISMATCH]
    assert len(events) == 2 and events[0].attributes[names.TOKENIZER_FIRST_DIFFERENCE] == 0


def test_tokens_in_tokens_out_takes_the_engines_ids(sims):
    """--tokenize-via engine: the gateway routes on the replica's own ids (here a tokenizer it never
    loaded), cached, and says so on the tokenize span."""
    exporter = InMemorySpanExporter()
    configure_tracing("kvlab-gateway-test", extra=SimpleSpanProcessor(exporter))
    other_ep = next(e for e in sims if e.name.startswith("other"))

    async def go():
        async with _gateway([other_ep], EngineTokens()) as g:
            await _replicas(g, [other_ep])
            for _ in range(2):
                resp = await g.client.post(g.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
                assert resp.status == 200, await resp.text()
                body = await resp.json()
                assert int(resp.headers[names.HEADER_PROMPT_TOKENS]) == body["usage"]["prompt_tokens"]
            resp = await g.client.post(g.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert int(resp.headers[names.HEADER_PROMPT_TOKENS]) == (await resp.json())["usage"]["prompt_tokens"]
            health = await (await g.client.get(g.url + "/health")).json()
            assert health["tokenizer"]["source"] == "engine"

    asyncio.run(asyncio.wait_for(go(), 120))
    spans = [s for s in exporter.get_finished_spans() if span_role(s) == names.SPAN_GATEWAY_REQUEST]   # tokenization is on it
    assert [s.attributes[names.TOKENIZE_SOURCE] for s in spans] == ["engine"] * 3
    assert [s.attributes[names.TOKENIZE_CACHED] > 0 for s in spans] == [False, True, False]   # the repeat: cached


def test_a_chat_the_template_rejects_is_a_400_with_its_message(sims, tmp_path):
    chatml = tokenizer_zoo.chatml(tmp_path / "chatml")

    async def go():
        async with _gateway(sims[:1], PromptTokenizer(Tokenizer(chatml))) as g:
            resp = await g.client.post(g.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y", "tool_call_id": "1"}]})
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert "tool messages are not supported by this template" in err["message"]

    asyncio.run(asyncio.wait_for(go(), 60))
