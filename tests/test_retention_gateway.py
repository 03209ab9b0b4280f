"""The gateway's typed retention (gateway/retention.py): directives derived from chat roles, checked
against the real tokenizer's rendering and accepted by the simulator's parser."""

from __future__ import annotations

import asyncio
import json

from kvlab.engine.sim.retention import EVICT_FIRST, HIGH, NORMAL, PINNED, block_classes, parse
from kvlab.gateway.retention import RetentionSettings, derive, header
from kvlab.gateway.tokens import LocalTokens, PromptTokenizer, chat_args
from kvlab.tokenizer import Tokenizer

SYSTEM = "You are an agent. Think, then act. " * 12
TOOLS = "Tools: search(query), open(url), calculator(expr). " * 8
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "system", "content": TOOLS},
        {"role": "user", "content": "Task: find the answer."},
        {"role": "assistant", "content": "Action: search(the answer)."},
        {"role": "user", "content": "Observation: nothing found."}]

_tok = LocalTokens(PromptTokenizer(Tokenizer()))


def _derive(payload, mode="typed", hint=None):
    args = chat_args(payload)
    tokens, _ = asyncio.run(_tok.encode_chat(payload["messages"], **args))
    found = asyncio.run(derive(RetentionSettings(mode=mode), payload, tokens, hint, _tok, args))
    return tokens, found


def _ids(messages):
    return asyncio.run(_tok.encode_chat(messages, add_generation_prompt=False))[0]


def test_roles_map_to_kinds_at_their_token_boundaries():
    tokens, ds = _derive({"messages": CHAT})
    assert [d.kind for d in ds] == ["system", "tools", "conversation", "output"]
    sys_end, tools_end = len(_ids(CHAT[:1])), len(_ids(CHAT[:2]))
    assert (ds[0].start, ds[0].end, ds[0].priority) == (0, sys_end, 100)
    assert (ds[1].start, ds[1].end, ds[1].priority) == (sys_end, tools_end, 80)
    assert (ds[2].start, ds[2].end) == (tools_end, len(tokens))
    assert (ds[3].start, ds[3].end, ds[3].priority) == (len(tokens), None, 10)
    # the simulator accepts the wire form and types the blocks as meant
    directives = parse(json.loads(header(ds)))
    classes = block_classes(directives, len(tokens) // 16, 16)
    assert classes[0] == PINNED and classes[sys_end // 16 + 1] == HIGH
    assert classes[-1] == NORMAL


def test_branch_hint_marks_the_last_reasoning_evict_first():
    tokens, ds = _derive({"messages": CHAT}, hint="branch")
    assert [d.kind for d in ds] == ["system", "tools", "conversation", "branch"]
    assert ds[3].start == len(_ids(CHAT[:3])) and ds[3].end is None
    classes = block_classes(parse(json.loads(header(ds))), len(tokens) // 16, 16)
    assert classes[-1] == EVICT_FIRST


def test_single_system_message_and_no_system_message():
    _, ds = _derive({"messages": CHAT[:1] + CHAT[2:]})
    assert [d.kind for d in ds] == ["system", "conversation", "output"]
    _, ds = _derive({"messages": CHAT[2:]})
    assert [d.kind for d in ds] == ["conversation", "output"]


def test_greedy_pins_the_whole_prompt_and_off_derives_nothing():
    tokens, ds = _derive({"messages": CHAT}, mode="greedy")
    assert [(d.kind, d.start, d.end, d.priority) for d in ds] == [("prompt", 0, len(tokens), 100),
                                                                 ("output", len(tokens), None, 10)]
    assert _derive({"messages": CHAT}, mode="off")[1] == []


def test_gateway_sends_derived_directives_upstream_and_passes_client_hints():
    from kvlab.telemetry import names
    from test_gateway import Harness, run

    body = {"model": "m", "max_tokens": 4, "messages": CHAT}

    async def go():
        async with Harness("kv-aware-typed", n=1) as h:
            st, _, _ = await h.post("/v1/chat/completions", body)
            assert st == 200
            async with h.client.post(h.url + "/v1/chat/completions", json=body,
                                     headers={names.HEADER_KV_HINT: "branch"}) as resp:
                assert resp.status == 200
            own = '[{"start":0,"end":16,"priority":95}]'
            async with h.client.post(h.url + "/v1/chat/completions", json=body,
                                     headers={names.HEADER_RETENTION: own}) as resp:
                assert resp.status == 200
            return [hd.get(names.HEADER_RETENTION) for hd in h.replicas[0].headers], own

    sent, own = run(go())
    derived, branch, passed = (json.loads(s) for s in sent)
    assert [d["priority"] for d in derived] == [100, 50, 50, 10]   # the preset keeps tools normal
    assert branch[-1]["priority"] == 10 and branch[-1]["start"] < derived[-1]["start"]
    assert passed == json.loads(own)


def test_kv_aware_sends_no_directive():
    from kvlab.telemetry import names
    from test_gateway import Harness, run

    async def go():
        async with Harness("kv-aware", n=1) as h:
            st, _, _ = await h.post("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": CHAT})
            assert st == 200
            return h.replicas[0].headers[0]

    assert names.HEADER_RETENTION not in run(go())
