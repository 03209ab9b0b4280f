"""End to end: `kvlab engine sim --replicas 2` as a subprocess, driven by the official openai client."""

from __future__ import annotations

import json
import random
import subprocess
import time

import httpx
import openai
import pytest
import zmq

from conftest import free_port, sim_process
from kvlab.kvcache.events import AllBlocksCleared, BlockStored, decode_batch
from kvlab.kvcache.hashing import block_keys
from kvlab.telemetry import names
from kvlab.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
MODEL = "kvlab-tiny"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    port = free_port()
    with sim_process(tmp_path_factory.mktemp("sim"), "--replicas", "2", "--ports", str(port), "--seed", "3",
                     stdout=subprocess.PIPE) as (proc, info):
        assert json.loads(proc.stdout.readline()) == info      # the same ready JSON on stdout
        assert info["replicas"][0]["url"] == f"http://127.0.0.1:{port}"
        yield info["replicas"]
    assert proc.returncode == 0                                # SIGTERM is a clean shutdown


def client(rep) -> openai.OpenAI:
    return openai.OpenAI(base_url=rep["url"] + "/v1", api_key="unused", max_retries=0)


def test_ready_json_follows_the_contract(sim):
    assert [r["name"] for r in sim] == ["sim-0", "sim-1"]
    for r in sim:
        assert set(r) == {"name", "url", "kv_events", "kv_replay", "role", "dp_rank", "replica"}
        assert r["kv_events"].startswith("tcp://127.0.0.1:") and r["role"] == "both"
    assert len({r["url"] for r in sim}) == 2 and len({r["kv_events"] for r in sim}) == 2


def test_openai_client_completions_and_chat_streaming_and_not(sim):
    c = client(sim[0])
    assert [m.id for m in c.models.list().data] == [MODEL]
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="the quick brown fox", max_tokens=7)
    assert raw.headers[names.HEADER_REPLICA] == "sim-0"
    comp = raw.parse()
    assert comp.usage.completion_tokens == 7 and comp.choices[0].finish_reason == "length"
    assert comp.usage.prompt_tokens_details.cached_tokens == 0
    assert len(Tokenizer().encode(comp.choices[0].text)) == 7

    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi there"}])
    assert chat.usage.completion_tokens == 16                     # the default max_tokens
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content.strip()
    # the prompt is the chat template rendered and encoded, as vLLM does
    tok = Tokenizer()
    assert chat.usage.prompt_tokens == len(tok.encode(tok.render_chat([{"role": "user", "content": "hi there"}])))

    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi there"}],
                                       max_tokens=6, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert len(pieces) == 6 and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens is not None

    stream = c.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=7, stream=True)
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert text == comp.choices[0].text                            # deterministic per prompt and seed


def test_tokenize_like_vllm(sim):
    r = httpx.post(sim[1]["url"] + "/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert r.status_code == 200 and r.headers[names.HEADER_REPLICA] == "sim-1"
    body = r.json()
    assert body["tokens"] == Tokenizer().encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 4096
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(sim[1]["url"] + "/tokenize", json={"messages": msgs})
    tok = Tokenizer()
    assert r.json()["tokens"] == tok.encode(tok.render_chat(msgs))


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 4090, "max_tokens": 16}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_input_is_an_openai_error_never_a_500(sim, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(sim[0]["url"] + path, **kw)
    assert r.status_code == status
    assert r.headers[names.HEADER_REPLICA] == "sim-0"
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    if param:
        assert err["param"] == param


def test_openai_client_sees_the_errors(sim):
    c = client(sim[0])
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model=MODEL, prompt=[5] * 4090, max_tokens=16)


def test_kv_events_for_stored_blocks_and_reset(sim):
    rep = sim[0]
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sock.linger = 0
    sock.connect(rep["kv_events"])
    time.sleep(0.3)  # PUB/SUB slow joiner
    prompt = [random.Random(9).randrange(3, 2000) for _ in range(70)]   # 4 full blocks of 16
    client(rep).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    httpx.post(rep["url"] + "/reset_prefix_cache").raise_for_status()
    stored, cleared, seqs = [], False, []
    deadline = time.monotonic() + 10
    while not cleared and time.monotonic() < deadline:
        if sock.poll(200):
            topic, seq, payload = sock.recv_multipart()
            assert topic == b"kv-events"
            seqs.append(int.from_bytes(seq, "big"))
            for ev in decode_batch(payload).events:
                stored += [ev] if isinstance(ev, BlockStored) else []
                cleared |= isinstance(ev, AllBlocksCleared)
    sock.close()
    assert cleared, "no AllBlocksCleared after /reset_prefix_cache"
    assert seqs == sorted(seqs)
    mine = [ev for ev in stored if ev.token_ids[:16] == prompt[:16]]
    assert mine, "no BlockStored for the prompt"
    tokens = [t for ev in stored for t in ev.token_ids if ev in mine]
    assert tokens[:64] == prompt[:64] and all(ev.block_size == 16 for ev in mine)
    # same tokens -> same gateway keys: the index can be rebuilt from the events
    assert block_keys(tokens, 16) == block_keys(prompt, 16)[:len(tokens) // 16]
    assert mine[0].parent_block_hash is None and len(mine[0].block_hashes) == len(mine[0].token_ids) // 16


def _ttft(c: openai.OpenAI, prompt) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    ttft, usage = None, None
    for chunk in c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                      stream_options={"include_usage": True}):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - t0
        usage = chunk.usage or usage
    return ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_repeated_2000_token_prompt_is_cached_and_much_faster(sim):
    tok = Tokenizer()
    rng = random.Random(2000)
    from kvlab.tokenizer import words
    vocab = words()
    text = ""
    while len(tok.encode(text)) < 2000:
        text += " ".join(rng.choice(vocab) for _ in range(100)) + " "
    ids = tok.encode(text)[:2000]
    c = client(sim[1])
    cold, n, cached0 = _ttft(c, ids)
    warm, _, cached1 = _ttft(c, ids)
    assert n == 2000 and cached0 == 0
    assert cached1 >= 0.9 * n
    assert warm * 3 <= cold, f"TTFT cold {cold * 1e3:.0f} ms vs warm {warm * 1e3:.0f} ms"
    # the other replica has its own cache
    _, _, other = _ttft(client(sim[0]), ids)
    assert other == 0
