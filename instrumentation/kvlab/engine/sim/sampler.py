"""What the simulated model says: deterministic word tokens, cheap to stream.

Candidates are the tokenizer's ordinary ids whose text is a space and a word (`" house"`), so
every streamed chunk is visible text and TTFT is well defined. The output of a request
depends only on the simulator seed and the prompt (or on the request's own `seed`).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

from kvlab.tokenizer import Tokenizer

_WORD = re.compile(r"^ [A-Za-z]+$")


class Sampler:
    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.seed = seed
        ids = tokenizer.visible_ids
        texts = {i: tokenizer.decode([i]) for i in ids}
        self.candidates = [i for i in ids if _WORD.match(texts[i])]
        if not self.candidates:  # a tokenizer without word tokens: any visible non-blank text
            self.candidates = [i for i in ids if texts[i].strip()]
        # id -> text, and id -> its text JSON-escaped (without quotes) for streaming chunks
        self.text = {i: texts[i] for i in self.candidates}
        self.json = {i: json.dumps(t)[1:-1].encode() for i, t in self.text.items()}

    def draw(self, prompt: Sequence[int], n: int, seed: int | None = None) -> list[int]:
        """`n` output ids for this prompt."""
        rng = random.Random(seed if seed is not None else hash((self.seed, *prompt)))
        return rng.choices(self.candidates, k=n)

    def detokenize(self, ids: list[int]) -> str:
        text = self.text
        return "".join([text[i] for i in ids])
