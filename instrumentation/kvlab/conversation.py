"""An OpenAI chat request as the model's chat template sees it, by vLLM 0.32's rules.

The engine does not hand the request's `messages` to the template as they are: it joins text
parts with newlines (or keeps them as parts when the template loops over `content`), parses tool
call arguments into objects, keeps `tool_call_id`/`name`/`reasoning`, maps `developer` to `system`
when the template does not know that role, and normalises `tools` the way its request model
serialises them. Token ids only match the engine's if the gateway does exactly the same
(`vllm/renderers/chat_utils.py`, `vllm/renderers/hf.py`). Only text content is modelled: image or
audio parts are dropped, so such requests route on their text alone.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2.nodes

from kvlab.errors import RequestError

_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
_KNOWN_PART_KEYS = frozenset({"type", "text", "refusal", "thinking", "closed", "uuid", "image_url",
                              "input_audio", "audio_url", "video_url", "image_embeds", "audio_embeds",
                              "video_embeds", "image_pil", "data", "name", "file", "detail"})
_BILLING_HEADER = "x-anthropic-billing-header"


def _texts(parts: list[Any], role: str, i: int) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if role == "system":   # vLLM drops Claude Code's per-request attribution line
        parts = [_strip_billing(p) for p in parts]
    for p in parts:
        if p is None:
            continue
        if isinstance(p, str):
            out.append((p, {}))
            continue
        if not isinstance(p, dict):
            raise RequestError("message content parts must be objects", f"messages[{i}].content")
        key = _TEXT_PARTS.get(p.get("type"))  # type: ignore[arg-type]
        if key is None:
            continue                          # media: the engine inserts placeholders we cannot know
        text = p.get(key)
        if text is None:
            continue
        if not isinstance(text, str):
            raise RequestError(f"a {p.get('type')} content part needs a string `{key}`", f"messages[{i}].content")
        out.append((text, {k: v for k, v in p.items() if k not in _KNOWN_PART_KEYS}))
    return out


def _strip_billing(p: Any) -> Any:
    text = p if isinstance(p, str) else p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
    if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
        return p
    rest = text.partition("\n")[2]
    if not rest:
        return None
    return rest if isinstance(p, str) else {**p, "text": rest}


def _arguments(tool_calls: list[Any]) -> list[Any]:
    out = []
    for item in tool_calls:
        if not isinstance(item, dict) or not isinstance(item.get("function"), dict):
            raise RequestError("assistant tool_calls entries must be objects with a `function`", "tool_calls")
        fn = dict(item["function"])
        args = fn.get("arguments")
        if not args:
            parsed: Any = {}
        elif isinstance(args, dict):
            parsed = args
        else:
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                parsed = {}
            if not isinstance(parsed, dict):
                parsed = {}
        fn["arguments"] = parsed
        out.append({**item, "function": fn})
    return out


def messages(raw: Any, content_format: str, template: str) -> list[dict[str, Any]]:
    """The conversation vLLM renders for `raw` (an OpenAI `messages` list)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("`messages` must be a non-empty list", "messages")
    conv: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError("each message must be an object with a string `role`", "messages")
        role, content = m["role"], m.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = content
        else:
            raise RequestError("message content must be a string or a list of parts", f"messages[{i}].content")
        texts = _texts(parts, role, i)
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t, **extra} for t, extra in texts]
        else:
            msg["content"] = "\n".join(t for t, _ in texts)
        if role == "assistant":
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = list(m["tool_calls"])
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if isinstance(m.get("task"), str):
            msg["task"] = m["task"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        conv.append(msg)
    for msg in conv:
        if msg["role"] == "assistant" and isinstance(msg.get("tool_calls"), list):
            if msg["tool_calls"]:
                msg["tool_calls"] = _arguments(msg["tool_calls"])
            else:
                del msg["tool_calls"]
    if any(msg["role"] == "developer" for msg in conv) and not _knows_developer(template):
        conv = _developer_as_system(conv)
    return conv


def _knows_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    conv = [({**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer" else m)
            for m in conv]
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if not systems or systems == [0]:
        return conv
    texts = []
    for i in systems:
        c = conv[i].get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] if isinstance(p, dict) else p for p in c)
        if c:
            texts.append(c)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in conv if m["role"] != "system")]


def tools(raw: Any) -> list[dict[str, Any]] | None:
    """`tools` as vLLM serialises its request model: type + function(name, description, parameters)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RequestError("`tools` must be a list", "tools")
    out = []
    for t in raw:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError("each tool needs a `function` with a string `name`", "tools")
        f: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                             "parameters": fn.get("parameters")}
        defer = t.get("defer_loading")
        for key, value in (("strict", fn.get("strict")), ("defer_loading", fn.get("defer_loading", defer))):
            if value is not None:
                f[key] = value
        tool: dict[str, Any] = {"type": t.get("type", "function"), "function": f}
        if defer is not None:
            tool["defer_loading"] = defer
        out.append(tool)
    return out


@lru_cache(maxsize=32)
def content_format(template: str) -> str:
    """`openai` when the template loops over a message's content parts, else `string` (vLLM's rule)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # parsed by the environment transformers renders with (its `generation` tag included)
    ast = _compile_jinja_template(template).environment.parse(template)
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, (jinja2.nodes.Filter, jinja2.nodes.Test)) and it.node is not None:
            it = it.node
        if (isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const)
                and it.arg.value == "content"):
            return "openai"
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return "openai"
    return "string"
