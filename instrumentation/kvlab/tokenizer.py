"""The tokenizer every kvlab part shares: gateway, simulator, `kvlab tokenize` and the tiny model.

By default a small byte-level BPE that kvlab builds itself from its own word list (no network),
shipped in `kvlab/assets/tokenizer/` as a Hugging Face tokenizer directory (`tokenizer.json` +
`tokenizer_config.json` with a ChatML chat template), so real vLLM loads the very same files.
Its alphabet is printable ASCII, so every token id decodes to visible text: a random-weight model
never streams an empty chunk, and "first non-empty token" TTFT is well defined. Any other HF
tokenizer directory can be given instead (`--tokenizer DIR`).

It is loaded with `transformers`' `AutoTokenizer` and chats are rendered with its
`apply_chat_template`, exactly what vLLM runs: the post-processor that adds BOS, the template
from `chat_template.jinja` or `tokenizer_config.json` (a string or a named list), the jinja
environment and variables (`bos_token`, `tools`, ...) are transformers' own, so the token ids
the gateway hashes are the ids the engine caches (docs/gateway.md, "Bring your own model").
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import cached_property
from importlib import resources
from inspect import Parameter, signature
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer as _HFTokenizer

from kvlab import conversation
from kvlab.errors import ConfigError, RequestError

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"]
DEFAULT_VOCAB_SIZE = 2048
CHAT_SAMPLE = [{"role": "user", "content": "Hello!"}]   # rendered once at load: a broken template fails early


def default_dir() -> Path:
    """The shipped default tokenizer directory."""
    return Path(str(resources.files("kvlab") / "assets" / "tokenizer"))


def words() -> list[str]:
    """kvlab's word list: the tokenizer's training text and the workloads' vocabulary."""
    text = (resources.files("kvlab") / "assets" / "words.txt").read_text()
    return [w for w in text.split() if w]


def _template_file(path: Path) -> str:
    """Where the directory keeps its chat template (for error messages)."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (path / name).is_file():
            return str(path / name)
    return str(path / "tokenizer_config.json")


class Tokenizer:
    """A Hugging Face tokenizer directory, loaded as vLLM loads it."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else default_dir()
        if not self.path.is_dir():
            raise ConfigError(f"tokenizer directory {self.path} does not exist")
        if not any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ConfigError(f"no tokenizer.json or tokenizer_config.json in {self.path}: "
                              "pass a Hugging Face tokenizer directory")
        try:
            from transformers import PreTrainedTokenizerFast
            from transformers.utils import logging as hf_logging
        except ImportError as exc:
            raise ConfigError(f"loading a Hugging Face tokenizer needs `transformers`: {exc}") from None
        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        try:
            if _tokenizer_class(self.path) == "PreTrainedTokenizerFast":
                # the class AutoTokenizer picks for this config, without AutoTokenizer's model registry,
                # which imports torch: ~3 s and ~300 MB less in every gateway and simulator process
                self.hf = PreTrainedTokenizerFast.from_pretrained(str(self.path), local_files_only=True)
            else:
                from transformers import AutoTokenizer

                self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:  # transformers raises many kinds; all mean "not loadable"
            raise ConfigError(f"{self.path}: transformers cannot load this tokenizer: "
                              f"{type(exc).__name__}: {exc}") from None
        tok: _HFTokenizer | None = getattr(self.hf, "backend_tokenizer", None)
        if tok is None:
            raise ConfigError(f"{self.path}: only fast tokenizers (tokenizer.json) are supported, "
                              f"got {type(self.hf).__name__}")
        self._tok = tok
        self.template_file = _template_file(self.path)
        params = signature(type(self.hf).apply_chat_template).parameters.values()
        self._chat_params = frozenset(p.name for p in params
                                      if p.kind not in (Parameter.VAR_KEYWORD, Parameter.VAR_POSITIONAL))
        if self.hf.chat_template is not None:
            try:
                self.render_chat(CHAT_SAMPLE)
            except RequestError as exc:
                raise ConfigError(f"{self.template_file}: the chat template cannot be rendered: "
                                  f"{exc.message}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @cached_property
    def eos_token_id(self) -> int | None:
        eos: int | None = self.hf.eos_token_id
        return eos

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of kvlab's special tokens and the tokenizer's own special tokens."""
        ours = (self._tok.token_to_id(t) for t in SPECIAL_TOKENS)
        return frozenset(i for i in ours if i is not None) | frozenset(self.hf.all_special_ids)

    @cached_property
    def visible_ids(self) -> list[int]:
        """Ids of ordinary (non-special) tokens: what a simulated model may emit."""
        special = self.special_ids
        added = set(self._tok.get_added_tokens_decoder())
        return [i for i in range(self.vocab_size) if i not in special and i not in added]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` as vLLM sets it: True for completion prompts
        (the post-processor adds BOS, even when the text already starts with one, as vLLM does),
        False for a rendered chat (the template wrote them)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[Any], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, tools: Any = None, documents: Any = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text vLLM builds from an OpenAI chat request with this model's template.

        Raises RequestError (a 400) when the request is malformed or the template rejects it,
        carrying the template's own message."""
        if self.hf.chat_template is None:
            raise RequestError(f"{self.path} has no chat template: use completions with a prompt", "messages")
        if add_generation_prompt and continue_final_message:
            raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                               "continue_final_message")
        kwargs = dict(chat_template_kwargs or {})
        if {"chat_template", "tokenize"} & kwargs.keys():
            raise RequestError("chat_template_kwargs must not set `chat_template` or `tokenize`",
                               "chat_template_kwargs")
        tool_dicts = conversation.tools(tools)
        try:
            template = self.hf.get_chat_template(None, tools=tool_dicts)
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from None
        try:
            fmt, variables = conversation.content_format(template), _template_vars(template)
        except Exception as exc:  # a syntax error: jinja2.TemplateSyntaxError names the line
            raise RequestError(f"the chat template does not compile: {_reason(exc)}", "messages") from None
        conv = conversation.messages(messages, fmt, template)
        for k, v in (("add_generation_prompt", add_generation_prompt),
                     ("continue_final_message", continue_final_message), ("documents", documents)):
            if v is not None:
                kwargs[k] = v
        accepted = self._chat_params | variables
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        hf_tools: list[dict[Any, Any] | Callable[..., Any]] | None = None if tool_dicts is None else [*tool_dicts]
        try:
            # tokenize=False: the rendered text, a str
            return cast(str, self.hf.apply_chat_template(conv, tools=hf_tools, chat_template=template,
                                                         tokenize=False, **kwargs))
        except Exception as exc:  # the template rejected this request (raise_exception, bad shape)
            raise RequestError(f"the chat template rejected the request: {_reason(exc)}", "messages") from None


def _tokenizer_class(path: Path) -> str | None:
    """The `tokenizer_class` a tokenizer directory's config names, if it names one."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def _template_vars(template: str) -> frozenset[str]:
    return _vars_cache.get(template) or _vars_cache.setdefault(template, _find_vars(template))


_vars_cache: dict[str, frozenset[str]] = {}


def _find_vars(template: str) -> frozenset[str]:
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(template).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


def _reason(exc: BaseException) -> str:
    """The most specific message in an exception chain (the template's own, when it raised)."""
    import jinja2

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, jinja2.TemplateError):
            return str(cur)
        cur = cur.__cause__ or cur.__context__
    return str(exc)


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
