"""Fetch a Hugging Face model's tokenizer files into a directory (the gateway's init container).

On GPU clusters vLLM tokenizes with the real model's tokenizer; the gateway must hash the very
same token ids, so before it starts it gets that model's `tokenizer.json` and
`tokenizer_config.json`. HF_TOKEN (optional, from the user's Secret) is read from the environment.

    python -m kvlab.stack.kind.hub MODEL DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

# chat_template.jinja: where transformers 4.4x+/5.x save the template (the gateway renders chats with it)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def fetch_tokenizer(model: str, out: Path) -> list[Path]:
    """Download the tokenizer files `model` has into `out`; tokenizer.json is required."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    out.mkdir(parents=True, exist_ok=True)
    got = []
    for name in TOKENIZER_FILES:
        try:
            got.append(Path(hf_hub_download(model, name, local_dir=out)))
        except EntryNotFoundError:
            if name == "tokenizer.json":
                raise
    return got


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m kvlab.stack.kind.hub MODEL DIR", file=sys.stderr)
        return 2
    for path in fetch_tokenizer(args[0], Path(args[1])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
