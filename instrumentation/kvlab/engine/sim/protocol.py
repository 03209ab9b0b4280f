"""The request bodies of the OpenAI/vLLM API the simulator accepts, as msgspec structs.

Decoding (kvlab.httpedge.decode) validates types in one pass: a wrong type becomes a 400 naming
the field (`$.max_tokens`).
Unknown fields are ignored, as OpenAI-compatible servers do, so every client's extras pass.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvlab.engine.sim.transfer import KVTransferParams
from kvlab.errors import RequestError


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Generation(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    kv_transfer_params: KVTransferParams | None = None   # P/D (engine/sim/transfer.py)


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[Any]


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Generation, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them; text parts are joined with newlines."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise RequestError(f"only text content parts are supported, got {part.type!r}",
                                       param=f"messages[{i}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        out.append({"role": m.role, "content": content})
    return out
