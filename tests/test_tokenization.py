"""Tokenization parity with `transformers` (what vLLM runs) over a zoo of tokenizer shapes.

Each zoo directory is built locally (tests/tokenizer_zoo.py). The reference is transformers
itself: `AutoTokenizer(text)` for completion prompts (BOS from the post-processor), and for chats
`apply_chat_template(conversation, tools=..., tokenize=False)` then `tokenizer(text,
add_special_tokens=False)`, with the conversation vLLM 0.32 builds from the request (text parts
joined by newlines for string templates, kept as parts for templates that loop over them, tool
call arguments parsed into objects). The gateway's cached path is checked cold and warm.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

import tokenizer_zoo
from kvlab.errors import ConfigError, RequestError
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.tokenizer import Tokenizer, words

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "You are terse.\nAnswer in one line."}
USER = {"role": "user", "content": "What is a cat?  Say it\n\nwith feeling."}
ASSISTANT = {"role": "assistant", "content": "A small  feline."}
USER2 = {"role": "user", "content": "And a dog?"}
PARTS = {"role": "user", "content": [{"type": "text", "text": "part one."}, {"type": "text", "text": "part two"}]}


def _text(n_words: int, seed: int) -> str:
    vocab = words()
    return " ".join(vocab[(i * 7919 + seed) % len(vocab)] for i in range(n_words))


COMPLETIONS = [
    "hello world",
    "  leading spaces, trailing space ",
    "line one\nline two\n\n  indented\tand tabbed\n",
    _text(1500, 1) + "\n" + _text(300, 2),
]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, dict]:
    from transformers import AutoTokenizer

    dirs = tokenizer_zoo.build(tmp_path_factory.mktemp("zoo"))
    return {name: {"dir": d, "ref": AutoTokenizer.from_pretrained(str(d)), "tok": Tokenizer(d)}
            for name, d in dirs.items()}


def _ref_chat(ref, conversation, **kwargs) -> list[int]:
    text = ref.apply_chat_template(conversation, tokenize=False, **kwargs)
    return ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", list(tokenizer_zoo.ZOO))
def test_completions_match_transformers(zoo, name):
    z = zoo[name]
    ref, prompts = z["ref"], PromptTokenizer(z["tok"])
    bos = ref.bos_token if name in ("llama3", "sentencepiece") else None
    texts = COMPLETIONS + [t for t in (ref.eos_token + " after eos", (bos or "") + "starts with bos") if t]
    for text in texts:
        want = ref(text)["input_ids"]
        assert z["tok"].encode(text, add_special_tokens=True) == want
        assert prompts.encode_text(text)[0] == want               # cold
        ids, hit = prompts.encode_text(text)
        assert ids == want and (hit > 0 or len(want) < 3)          # warm, from the piece cache
        assert prompts.encode_text(text, add_special_tokens=False)[0] == ref(text, add_special_tokens=False)["input_ids"]
    if bos is not None:   # BOS from the post-processor; twice when the text starts with it, as vLLM does
        ids = prompts.encode_text(bos + "starts with bos")[0]
        assert ids[:2] == [ref.bos_token_id] * 2


def _cases(name: str, openai_parts: bool) -> list[tuple[str, list, dict, list]]:
    """(case, request messages, request fields, the conversation vLLM renders)."""
    parts_conv = ({"role": "user", "content": [{"type": "text", "text": "part one."}, {"type": "text", "text": "part two"}]}
                  if openai_parts else {"role": "user", "content": "part one.\npart two"})
    out = [("system+user", [SYSTEM, USER], {}, [SYSTEM, USER]),
           ("multi-turn", [USER, ASSISTANT, USER2], {}, [USER, ASSISTANT, USER2]),
           ("tools", [USER], {"tools": [TOOL]}, [USER]),
           ("text parts", [PARTS], {}, [parts_conv]),
           ("continue final", [USER, ASSISTANT], {"add_generation_prompt": False, "continue_final_message": True},
            [USER, ASSISTANT])]
    if name == "llama3":   # a tool round trip: arguments arrive as a JSON string, the template gets an object
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        msgs = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]}]
        conv = [USER, {"role": "assistant", "content": "",
                       "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
        out.append(("tool round trip", msgs, {"tools": [TOOL]}, conv))
    if name == "named":
        out.append(("chat_template_kwargs", [USER], {"chat_template_kwargs": {"enable_thinking": True}}, [USER]))
    return out


@pytest.mark.parametrize("name", list(tokenizer_zoo.ZOO))
def test_chats_match_transformers_apply_chat_template(zoo, name):
    z = zoo[name]
    ref, prompts = z["ref"], PromptTokenizer(z["tok"])
    for case, messages, fields, conversation in _cases(name, openai_parts=(name == "named")):
        kwargs = {"add_generation_prompt": fields.get("add_generation_prompt", True),
                  "continue_final_message": fields.get("continue_final_message", False),
                  **fields.get("chat_template_kwargs", {})}
        want = _ref_chat(ref, copy.deepcopy(conversation), tools=fields.get("tools"), **kwargs)
        got, _ = prompts.encode_chat(copy.deepcopy(messages), **fields)
        assert got == want, f"{name}/{case}"
        again, hit = prompts.encode_chat(copy.deepcopy(messages), **fields)
        assert again == want and hit > 0, f"{name}/{case} (warm)"


def test_template_sources_are_the_models_own(zoo):
    llama = zoo["llama3"]
    assert (llama["dir"] / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((llama["dir"] / "tokenizer_config.json").read_text())
    text = llama["tok"].render_chat([USER], tools=[TOOL])
    assert text.startswith("<|begin_of_text|>") and '"get_weather"' in text       # bos_token and tools read
    named = zoo["named"]["tok"]
    assert named.render_chat([USER], tools=[TOOL]).startswith("TOOLS:")            # the `tool_use` template
    assert not named.render_chat([USER]).startswith("TOOLS:")                      # the `default` one


def test_a_request_the_template_rejects_is_a_request_error_with_its_message(zoo):
    tok = zoo["chatml"]["tok"]
    with pytest.raises(RequestError, match="tool messages are not supported by this template") as err:
        tok.render_chat([USER, {"role": "tool", "content": "x", "tool_call_id": "1"}])
    assert err.value.status == 400
    with pytest.raises(RequestError, match="continue_final_message"):
        tok.render_chat([USER], add_generation_prompt=True, continue_final_message=True)


@pytest.mark.processes
def test_bad_directory_or_template_is_a_clear_start_up_error(tmp_path, zoo):
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        Tokenizer(tmp_path / "empty")
    broken = tmp_path / "broken"
    tokenizer_zoo.llama3(broken)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match=r"chat_template\.jinja"):
        Tokenizer(broken)
    r = subprocess.run([sys.executable, "-m", "kvlab.cli", "gateway", "--port", "1", "--endpoints",
                        "http://127.0.0.1:9", "--policy", "kv-aware", "--tokenizer", str(broken)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "chat_template.jinja" in r.stderr, r.stderr


@pytest.mark.processes
def test_kvlab_tokenize_prints_the_ids_the_gateway_routes_on(zoo, tmp_path):
    z = zoo["llama3"]
    prompt, chat = tmp_path / "prompt.txt", tmp_path / "chat.json"
    prompt.write_text("hello world\nagain")
    chat.write_text(json.dumps([SYSTEM, USER]))
    for flag, f, want in (("--prompt-file", prompt, z["ref"]("hello world\nagain")["input_ids"]),
                          ("--chat-file", chat, _ref_chat(z["ref"], [SYSTEM, USER], add_generation_prompt=True))):
        r = subprocess.run([sys.executable, "-m", "kvlab.cli", "tokenize", "--tokenizer", str(z["dir"]), flag, str(f)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out == {"ids": want, "source": "local", "tokenizer": str(z["dir"])}


@pytest.mark.processes
def test_kvlabs_own_tokenizer_loads_without_torch():
    """Every gateway, simulator and Locust process loads the tokenizer: for kvlab's own (a
    PreTrainedTokenizerFast) transformers' AutoTokenizer would import torch, ~3 s of CPU and ~300 MB
    a process; loading the class it names directly does not."""
    code = ("import sys; from kvlab.tokenizer import Tokenizer; t = Tokenizer(); "
            "t.render_chat([{'role': 'user', 'content': 'hi'}]); print(sorted(m for m in ('torch', 'tensorflow') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
