"""A zoo of Hugging Face tokenizer directories built locally (no downloads), one per shape a user
may bring: trained with `tokenizers` on kvlab's word list, saved with `transformers`.

- `llama3`: byte-level BPE, BOS added by a TemplateProcessing post-processor, the template in
  `chat_template.jinja` (as transformers 4.4x+/5.x save it) reading `bos_token` and `tools`;
- `chatml`: byte-level BPE without BOS, a ChatML template inline in `tokenizer_config.json`;
- `sentencepiece`: Unigram + Metaspace (SentencePiece-style) with `<s>` BOS, a Llama-2 template;
- `gpt2`: byte-level BPE, ByteLevel post-processor (no BOS), a minimal template;
- `named`: a named template list (`default` looping over content parts, `tool_use`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from kvlab.tokenizer import words

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call these tools:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}"
    "{%- if message.tool_calls is defined %}{%- for c in message.tool_calls %}"
    "{{ c.function.name }}({{ c.function.arguments | tojson }}){%- endfor %}{%- endif %}<|eot_id|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are "
    "not supported by this template') }}{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>\n{{ m['content'] }}\n<</SYS>>\n\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
GPT2_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
NAMED_DEFAULT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"
)
NAMED_TOOLS = "TOOLS:{{ tools | tojson }}\n" + NAMED_DEFAULT


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = words()
    printable = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    return [printable] + [" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 14))) + rng.choice(".?!\n")
                          for _ in range(1500)]


def _bpe(special: list[str], vocab_size: int = 600) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                           show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _save(tok: Tokenizer, out: Path, template: str | None = None, inline_template: object = None, **special) -> Path:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(str(out))
    if inline_template is not None:   # the older layout: the template inside tokenizer_config.json
        cfg_file = out / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["chat_template"] = inline_template
        cfg_file.write_text(json.dumps(cfg, indent=2))
    return out


def llama3(out: Path) -> Path:
    bos, eot = "<|begin_of_text|>", "<|eot_id|>"
    special = [bos, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", eot]
    tok = _bpe(special)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    path = _save(tok, out, LLAMA3_TEMPLATE, bos_token=bos, eos_token=eot)
    assert (path / "chat_template.jinja").is_file()
    return path


def chatml(out: Path) -> Path:
    tok = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return _save(tok, out, inline_template=CHATML_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def sentencepiece(out: Path) -> Path:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.normalizer = None
    tok.train_from_iterator(_corpus(1), trainers.UnigramTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                                                unk_token="<unk>", show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return _save(tok, out, inline_template=LLAMA2_TEMPLATE, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def gpt2(out: Path) -> Path:
    tok = _bpe(["<|endoftext|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return _save(tok, out, inline_template=GPT2_TEMPLATE, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def named(out: Path) -> Path:
    tok = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return _save(tok, out, inline_template=[{"name": "default", "template": NAMED_DEFAULT},
                                            {"name": "tool_use", "template": NAMED_TOOLS}],
                 eos_token="<|im_end|>")


ZOO = {"llama3": llama3, "chatml": chatml, "sentencepiece": sentencepiece, "gpt2": gpt2, "named": named}


def build(root: Path) -> dict[str, Path]:
    return {name: make(root / name) for name, make in ZOO.items()}
