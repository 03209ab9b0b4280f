"""A generation continued on another replica after its replica failed (docs/reliability.md).

What the client already received is the resume's input: the text streamed so far goes back as the
final assistant message (chat, vLLM's `continue_final_message`) or appended to the prompt
(completions), with the remaining `max_tokens`, to a healthy replica the dead one is excluded
from. The same request body serves chunked decoding's later chunks (gateway/chunked/). The
client sees one stream: the first replica's id and created on every event, the role delta once,
one finish reason, and usage with the prompt counted once and the completion tokens summed.
A request that never streamed a token (or was not streamed) is simply sent again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from kvlab.contract import Usage
from kvlab.gateway.endpoints import Backend


def resume_body(payload: dict[str, Any], operation: str, generated: str) -> dict[str, Any]:
    """The original request with the text generated so far appended (chat: as the assistant's
    final message to continue; completions: to the prompt)."""
    body = dict(payload)
    body.pop("kv_transfer_params", None)   # a P/D decode call's handle belongs to the first replica
    if operation == "chat":
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict) and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + generated}   # the client's own prefill
        else:
            messages.append({"role": "assistant", "content": generated})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = body["prompt"] + generated
    return body


def unresumable(payload: dict[str, Any], operation: str) -> str | None:
    """Why a started generation of this request cannot be continued elsewhere (None: it can)."""
    if payload.get("n", 1) not in (1, None) or payload.get("best_of", 1) not in (1, None):
        return "n > 1: several sampled choices cannot be continued as one text"
    if payload.get("logprobs") or payload.get("top_logprobs"):
        return "logprobs were asked: a resumed replica would not return the earlier tokens' logprobs"
    if payload.get("echo"):
        return "echo: the resumed prompt would be echoed again"
    if operation == "chat":
        if not isinstance(payload.get("messages"), list):
            return "messages is not a list"
    elif not isinstance(payload.get("prompt"), str):
        return "the prompt is not a single string (token ids or a batch)"
    return None


class _Delta(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class Event(msgspec.Struct):
    """The parts of one streamed chunk the resume needs."""

    id: str | None = None
    created: int | None = None
    choices: list[_Choice] = []
    usage: Usage | None = None
    error: Any = None


event_decoder = msgspec.json.Decoder(Event)


@dataclass(frozen=True, slots=True)
class Broken:
    """A replica failed while serving: `reason` (stream, timeout, error_event, ended, body)."""

    reason: str
    error: str
    replica: Backend


@dataclass(slots=True)
class Progress:
    """What the client has received of one request, across the replicas that served it."""

    prompt_tokens: int | None = None      # the gateway's count of the original prompt
    out: web.StreamResponse | None = None  # the client's stream once started
    ident: dict[str, Any] = field(default_factory=dict)   # the first replica's id and created
    text: str = ""                          # every piece of text sent to the client
    tokens: int = 0                         # completion tokens sent (streamed pieces)
    carried: int = 0                        # of those, sent before the current replica took over
    started: bool = False                   # the first event reached the client (TTFT taken)
    finished: bool = False                  # a finish reason was sent
    done: bool = False                      # [DONE] was sent
    resumes: int = 0
    pending: Broken | None = None           # the failure the next call resumes from (for its span event)

    def usage(self, u: Usage) -> Usage:
        """A resumed replica's usage as the client's: the original prompt once, completions summed."""
        if not self.resumes:
            return u
        completion = self.carried + (u.completion_tokens or 0)
        prompt = self.prompt_tokens if self.prompt_tokens else max(0, (u.prompt_tokens or 0) - self.carried)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, prompt_tokens_details=u.prompt_tokens_details)

    def usage_json(self, u: Usage) -> dict[str, Any]:
        """`usage` as the client gets it (with `total_tokens`)."""
        mine = self.usage(u)
        out: dict[str, Any] = {"prompt_tokens": mine.prompt_tokens, "completion_tokens": mine.completion_tokens,
                               "total_tokens": (mine.prompt_tokens or 0) + (mine.completion_tokens or 0)}
        if mine.prompt_tokens_details is not None:
            out["prompt_tokens_details"] = msgspec.to_builtins(mine.prompt_tokens_details)
        return out

    def rewrite(self, data: bytes, usage: Usage | None) -> bytes | None:
        """A resumed replica's event as part of the first one's stream (None: nothing left to send)."""
        obj = msgspec.json.decode(data)
        obj.update(self.ident)
        for ch in obj.get("choices") or []:
            delta = ch.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                if not delta.get("content") and ch.get("finish_reason") is None and not delta.get("tool_calls"):
                    ch["_empty"] = True
        obj["choices"] = [ch for ch in obj.get("choices") or [] if not ch.pop("_empty", False)]
        if usage is not None:
            obj["usage"] = self.usage_json(usage)
        elif not obj["choices"]:
            return None
        return b"data: " + msgspec.json.encode(obj)
