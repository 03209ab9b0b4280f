"""Typed retention directives derived by the gateway for chat requests (experimental).

The gateway knows the structure of a chat request that the engine only sees as tokens: which
tokens are the system prompt, which the tool set, which a turn of reasoning. With a policy's
`retention.mode: typed` it turns that structure into retention directives (token ranges with a
priority, shaped after vLLM's proposal RFC vllm-project/vllm#37003) and sends them to the replica
in the `x-kvlab-retention` header (docs/semantic-kv.md):

- the first system message: `system` (default 100, pinned);
- further leading system messages and the rendered `tools`: `tools` (80, high);
- the rest of the prompt: `conversation` (50, normal);
- generated tokens: `output` (10, evict-first): agent frameworks resend their own rendering of a
  turn (reasoning stripped, tool calls re-serialised), so the engine's generated blocks are rarely
  a prefix of the next request;
- with the client hint `x-kvlab-kv-hint: branch`, the reasoning from the last assistant message on:
  `branch` (10, evict-first) — a branch explored and abandoned.

`mode: greedy` pins the whole prompt (lab 09's counter-example). A request that carries its own
`retention_directives` (or the header) is passed through untouched: explicit client hints win.
Boundaries are found by tokenizing the leading messages alone (cached by the gateway's tokenizer)
and taking the common prefix with the full prompt, so any chat template works.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Protocol

import msgspec

from kvlab.config import Strict


class RetentionSettings(Strict, frozen=True):
    """A policy's `retention:` section (docs/gateway.md, docs/semantic-kv.md)."""

    mode: Literal["off", "typed", "greedy"] = "off"
    system: int = 100
    tools: int = 80
    conversation: int = 50
    output: int = 10
    branch: int = 10


class ChatTokens(Protocol):
    async def encode_chat(self, messages: Any, tool_choice: Any = None, **kwargs: Any) -> tuple[list[int], int]: ...


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Directive(msgspec.Struct, frozen=True, kw_only=True):
    start: int
    end: int | None
    priority: int
    kind: str   # what the range holds (kept in the span, not sent)


async def derive(settings: RetentionSettings, payload: dict[str, Any], tokens: list[int], hint: str | None,
                 tokenizer: ChatTokens, chat_args: dict[str, Any]) -> list[Directive]:
    """The directives of a chat request under `settings` ([] when off or nothing to type)."""
    messages = payload.get("messages")
    if settings.mode == "off" or not isinstance(messages, list) or not messages:
        return []
    n = len(tokens)
    if settings.mode == "greedy":
        return [Directive(start=0, end=n, priority=settings.system, kind="prompt"),
                Directive(start=n, end=None, priority=settings.output, kind="output")]
    args = {**chat_args, "add_generation_prompt": False}
    lead = 0
    while lead < len(messages) and isinstance(messages[lead], dict) and messages[lead].get("role") == "system":
        lead += 1

    async def boundary(upto: int, tools: bool) -> int:
        kw = args if tools else {**args, "tools": None}
        ids, _ = await tokenizer.encode_chat(messages[:upto], **kw)
        return _common(ids, tokens)

    out: list[Directive] = []
    start = 0
    if lead:
        sys_end = await boundary(1, tools=False)
        out.append(Directive(start=0, end=sys_end, priority=settings.system, kind="system"))
        start = sys_end
        if lead > 1 or chat_args.get("tools"):
            tools_end = await boundary(lead, tools=True)
            if tools_end > start:
                out.append(Directive(start=start, end=tools_end, priority=settings.tools, kind="tools"))
                start = tools_end
    branch_at = n
    if hint == "branch":
        last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=None)
        if last is not None and last >= lead:
            branch_at = max(start, await boundary(last, tools=True))
    if branch_at > start:
        out.append(Directive(start=start, end=branch_at, priority=settings.conversation, kind="conversation"))
    if branch_at < n:
        out.append(Directive(start=branch_at, end=None, priority=settings.branch, kind="branch"))
    else:
        out.append(Directive(start=n, end=None, priority=settings.output, kind="output"))
    return [d for d in out if d.end is None or d.end > d.start]


def header(directives: list[Directive]) -> str:
    """The `x-kvlab-retention` value: the wire shape of vLLM's proposal (kind dropped)."""
    return json.dumps([{"start": d.start, "end": d.end, "priority": d.priority} for d in directives],
                      separators=(",", ":"))


def span_value(directives: list[Directive]) -> str:
    """The typed prefix as the decision span shows it: [{kind, start, end, priority}]."""
    return json.dumps([{"kind": d.kind, "start": d.start, "end": d.end, "priority": d.priority}
                       for d in directives])
