"""The tokenizer every kvlab part shares: gateway, simulator and the tiny vLLM model.

By default a small byte-level BPE that kvlab builds itself from its own word list (no network),
shipped in `kvlab/assets/tokenizer/` as a Hugging Face tokenizer directory (`tokenizer.json` +
`tokenizer_config.json` with a ChatML chat template), so real vLLM loads the very same files.
Its alphabet is printable ASCII, so every token id decodes to visible text: a random-weight model
never streams an empty chunk, and "first non-empty token" TTFT is well defined. Any other HF
tokenizer directory can be given instead (`--tokenizer DIR`).
"""

from __future__ import annotations

import json
import random
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from kvlab.errors import ConfigError

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"]
DEFAULT_VOCAB_SIZE = 2048


def default_dir() -> Path:
    """The shipped default tokenizer directory."""
    return Path(str(resources.files("kvlab") / "assets" / "tokenizer"))


def words() -> list[str]:
    """kvlab's word list: the tokenizer's training text and the workloads' vocabulary."""
    text = (resources.files("kvlab") / "assets" / "words.txt").read_text()
    return [w for w in text.split() if w]


class Tokenizer:
    """A fast HF tokenizer plus the chat template from its `tokenizer_config.json`."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else default_dir()
        tok_file = self.path / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"no tokenizer.json in {self.path}: pass a Hugging Face tokenizer directory")
        self._tok = _HFTokenizer.from_file(str(tok_file))
        cfg_file = self.path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = self.config.get("chat_template") or CHAT_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        self._template = env.from_string(template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @cached_property
    def eos_token_id(self) -> int | None:
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        return self._tok.token_to_id(eos) if eos else None

    @cached_property
    def visible_ids(self) -> list[int]:
        """Ids of ordinary (non-special) tokens: what a simulated model may emit."""
        special = {self._tok.token_to_id(t) for t in SPECIAL_TOKENS}
        added = {i for i in self._tok.get_added_tokens_decoder()}
        return [i for i in range(self.vocab_size) if i not in special and i not in added]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as the engine computes them for a prompt (no BOS added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text the engine builds from chat messages with this model's template."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token="", eos_token="<|im_end|>")


def build_default(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> Path:
    """Train kvlab's byte-level BPE on text made from its word list; write an HF tokenizer dir.

    Deterministic for a given seed. The training text covers every printable ASCII character
    (and newline, tab), and no others, so every id decodes to visible text and unknown characters map to `<unk>`.
    """
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    vocab = words()
    printable = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    lines = [printable, "\n\n".join(vocab[:50])]
    for _ in range(4000):
        lines.append(" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 16)))
                     + rng.choice([".", "?", "!", ",", ":", ";"]) + " " + str(rng.randint(0, 9999)))
    tok = _HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  show_progress=False, initial_alphabet=[])
    tok.train_from_iterator(lines, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<|im_end|>"}, indent=2) + "\n")
    return out


if __name__ == "__main__":  # regenerate the shipped assets: python -m kvlab.tokenizer
    print(build_default(default_dir()))
