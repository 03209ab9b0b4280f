"""Prompt tokenization at the gateway, cached by piece so a warm long prompt costs little.

The text the engine tokenizes (a completion prompt, or chat messages rendered with the model's
template, `kvlab.tokenizer`) is cut into pieces at points where the tokenizer itself never merges
across: added tokens with no strip/word flags (split out before pre-tokenization by every HF
tokenizer) and, for byte-level BPE, a newline followed by a non-space character (the GPT-2
pre-tokenizer always ends a pre-token there). Each piece's ids are cached (bounded LRU), so a
shared system prompt or document is tokenized once; only the new tail costs a real encode. The
post-processor's special tokens (BOS for a completion prompt, as vLLM adds them) wrap the pieces.
At start-up each rule is checked against a plain encode on samples made of this tokenizer's own
special tokens and template, and switched off if this tokenizer disagrees (down to whole-text
caching), so the cache never changes an id.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from kvlab.errors import RequestError
from kvlab.tokenizer import Tokenizer

_NEWLINE_CUT = re.compile(r"(?<=\n)(?=\S)")
_TEXT = ("You are a helpful assistant.\nAnswer briefly.\n\n  indented line\nlast: 42 words, "
         "more text!\n\tTab\nDone{special}\nuser\nhello {special} x{special}y\n{special}")

LOCAL = "local"


class PromptTokenizer:
    """`encode_text` / `encode_chat` -> (token ids, tokens served from the cache)."""

    source = LOCAL

    def __init__(self, tokenizer: Tokenizer | None = None, max_entries: int = 50_000) -> None:
        self.tok = tokenizer or Tokenizer()
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.max_entries = max_entries
        backend = self.tok._tok
        added = [t for t in backend.get_added_tokens_decoder().values()
                 if not (t.lstrip or t.rstrip or t.single_word)]
        specials = sorted((t.content for t in added), key=len, reverse=True)
        self._special_ids = {s: i for s in specials if (i := backend.token_to_id(s)) is not None}
        self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self._wrap = self._wrapper()
        self.cut_newlines = True
        samples = self._samples(specials)
        if not self._agrees(samples):
            self.cut_newlines = False
            if not self._agrees(samples):
                self._special_re = None   # whole-text caching only
                if not self._agrees(samples):
                    self._wrap = None     # the post-processor is not a plain prefix/suffix
        self._cache.clear()

    def _wrapper(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after a single sequence (BOS, EOS...)."""
        plain = self.tok.encode("a b", add_special_tokens=False)
        full = self.tok.encode("a b", add_special_tokens=True)
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
        return None

    def _samples(self, specials: list[str]) -> list[str]:
        out = [_TEXT.format(special=s) for s in specials[:8] or [""]]
        if self.tok.hf.chat_template is not None:
            out.append(self.tok.render_chat([{"role": "system", "content": "Be brief.\nReally."},
                                             {"role": "user", "content": "hello\nworld"}]))
        return out

    def _agrees(self, samples: list[str]) -> bool:
        for text in samples:
            for add in (False, True):
                self._cache.clear()
                if self.encode_text(text, add)[0] != self.tok.encode(text, add):
                    return False
        return True

    def _piece(self, text: str) -> tuple[tuple[int, ...], bool]:
        cache = self._cache
        ids = cache.get(text)
        if ids is not None:
            cache.move_to_end(text)
            return ids, True
        ids = tuple(self.tok.encode(text))
        cache[text] = ids
        if len(cache) > self.max_entries:
            cache.popitem(last=False)
        return ids, False

    def encode_text(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], int]:
        """A completion prompt's ids (vLLM's default: `add_special_tokens` true, BOS added)."""
        if add_special_tokens and self._wrap is None:
            return self.tok.encode(text, True), 0
        out: list[int] = []
        hit = 0
        parts = self._special_re.split(text) if self._special_re else [text]
        special = self._special_ids
        for i, part in enumerate(parts):
            if not part:
                continue
            if i % 2 == 1:  # re.split with a group: odd parts are the separators
                out.append(special[part])
                continue
            pieces = _NEWLINE_CUT.split(part) if self.cut_newlines else (part,)
            for piece in pieces:
                ids, cached = self._piece(piece)
                out.extend(ids)
                if cached:
                    hit += len(ids)
        if add_special_tokens and self._wrap is not None:
            before, after = self._wrap
            out = [*before, *out, *after] if before or after else out
        return out, hit

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, tools: Any = None, documents: Any = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    add_special_tokens: bool = False) -> tuple[list[int], int]:
        """A chat request's ids: rendered as vLLM renders it, special tokens not added again."""
        text = self.tok.render_chat(messages, add_generation_prompt, continue_final_message=continue_final_message,
                                    tools=tools, documents=documents, chat_template_kwargs=chat_template_kwargs)
        return self.encode_text(text, add_special_tokens)


def chat_args(payload: dict[str, Any]) -> dict[str, Any]:
    """The tokenization-relevant fields of a chat request, validated, with vLLM's defaults."""
    kwargs = payload.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    out: dict[str, Any] = {"chat_template_kwargs": kwargs, "tools": payload.get("tools"),
                           "documents": payload.get("documents"),
                           "tool_choice": payload.get("tool_choice")}   # the engine's render call needs it
    for key, default in (("add_generation_prompt", True), ("continue_final_message", False),
                         ("add_special_tokens", False)):
        v = payload.get(key, default)
        if not isinstance(v, bool):
            raise RequestError(f"`{key}` must be a boolean", key)
        out[key] = v
    return out


class LocalTokens:
    """The gateway's token source when it can load the model's tokenizer (the default)."""

    source = LOCAL

    def __init__(self, prompts: PromptTokenizer) -> None:
        self.prompts = prompts

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], int]:
        return self.prompts.encode_text(text, add_special_tokens)

    async def encode_chat(self, messages: Any, tool_choice: Any = None, **kwargs: Any) -> tuple[list[int], int]:
        return self.prompts.encode_chat(messages, **kwargs)
