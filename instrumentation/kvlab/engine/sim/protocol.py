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
from kvlab.tokenizer import Tokenizer


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
    retention_directives: Any = None     # experimental, parsed by engine/sim/retention.py (400 if bad)
    retention_scope: str | None = None   # accepted as vLLM's proposal has it; not used by the simulator


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[Any]
    add_special_tokens: bool = True            # vLLM's default: the post-processor adds BOS


class ChatRequest(_Generation, kw_only=True):
    """`messages` stay raw JSON: the conversation is built by vLLM's rules in one place
    (`kvlab.conversation`, through the tokenizer), for chat and /tokenize alike."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False           # vLLM's default for chat: the template wrote them
    tools: list[Any] | None = None
    documents: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None     # vLLM: true for a prompt, false for messages
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def chat_ids(body: ChatRequest | TokenizeRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt ids of a chat request (or a /tokenize request with `messages`), as vLLM makes them."""
    assert body.messages is not None  # a chat request has them; tokenize_ids checks
    text = tokenizer.render_chat(body.messages, body.add_generation_prompt,
                                 continue_final_message=body.continue_final_message, tools=body.tools,
                                 documents=getattr(body, "documents", None),
                                 chat_template_kwargs=body.chat_template_kwargs)
    return tokenizer.encode(text, bool(body.add_special_tokens))


def tokenize_ids(body: TokenizeRequest, tokenizer: Tokenizer) -> list[int]:
    if body.messages is not None:
        return chat_ids(body, tokenizer)
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, body.add_special_tokens is not False)
    raise RequestError("either `prompt` or `messages` is required", param="prompt")


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


