"""Prompt tokenization at the gateway, cached by piece so a warm long prompt costs little.

The text the engine tokenizes (a completion prompt, or chat messages rendered with the model's
template) is cut into pieces at points where the tokenizer itself never merges across:
special tokens (split out before pre-tokenization by every HF tokenizer) and, for byte-level BPE,
a newline followed by a non-space character (the GPT-2 pre-tokenizer always ends a pre-token
there). Each piece's ids are cached (bounded LRU), so a shared system prompt or document is
tokenized once; only the new tail costs a real encode. At start-up the cut rule is checked
against a plain encode on a sample and switched off if this tokenizer disagrees.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from kvlab.errors import RequestError
from kvlab.tokenizer import Tokenizer

_NEWLINE_CUT = re.compile(r"(?<=\n)(?=\S)")
_SAMPLE = ("You are a helpful assistant.\nAnswer briefly.\n\n  indented line\nlast: 42 words, "
           "more text!\n\tTab\nDone <|im_end|>\n<|im_start|>user\nhello\n")


class PromptTokenizer:
    """`encode_text` / `encode_chat` -> (token ids, tokens served from the cache)."""

    def __init__(self, tokenizer: Tokenizer | None = None, max_entries: int = 50_000) -> None:
        self.tok = tokenizer or Tokenizer()
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.max_entries = max_entries
        specials = sorted((t.content for t in self.tok._tok.get_added_tokens_decoder().values()),
                          key=len, reverse=True)
        self._special_ids = {s: self.tok._tok.token_to_id(s) for s in specials}
        self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self.cut_newlines = True
        if self.encode_text(_SAMPLE)[0] != self.tok.encode(_SAMPLE):
            self.cut_newlines = False
            self._cache.clear()
            if self.encode_text(_SAMPLE)[0] != self.tok.encode(_SAMPLE):
                self._special_re = None   # fall back to whole-text caching only
        self._cache.clear()

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

    def encode_text(self, text: str) -> tuple[list[int], int]:
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
        return out, hit

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], int]:
        try:
            text = self.tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template error is the client's message shape
            raise RequestError(f"cannot apply the chat template: {exc}", "messages") from None
        return self.encode_text(text)
