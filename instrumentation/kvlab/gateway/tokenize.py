"""`kvlab tokenize`: print the token ids the gateway routes on, to check parity by hand.

`--prompt-file F` tokenizes a completion prompt (BOS as the engine adds it); `--chat-file F`
renders an OpenAI `messages` list (or a whole chat request body with `tools`,
`chat_template_kwargs`, ...) with the model's template. Compare the output with the engine's
`POST /tokenize` (docs/gateway.md, "Bring your own model").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.errors import KvlabError


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvlab tokenize", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="Hugging Face tokenizer directory (default: kvlab's own)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path, help="a completion prompt (text)")
    src.add_argument("--chat-file", type=Path, help="JSON: a `messages` list or a chat request body")
    a = p.parse_args(argv)
    from kvlab.gateway.tokens import PromptTokenizer, chat_args
    from kvlab.tokenizer import Tokenizer

    try:
        tok = Tokenizer(a.tokenizer)
        prompts = PromptTokenizer(tok)
        if a.prompt_file is not None:
            ids, _ = prompts.encode_text(a.prompt_file.read_text())
        else:
            body = json.loads(a.chat_file.read_text())
            body = {"messages": body} if isinstance(body, list) else body
            if not isinstance(body, dict):
                raise KvlabError(f"{a.chat_file}: expected a messages list or a chat request object")
            args = chat_args(body)
            args.pop("tool_choice")
            ids, _ = prompts.encode_chat(body.get("messages"), **args)
    except (KvlabError, OSError, json.JSONDecodeError) as exc:
        print(f"kvlab tokenize: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"ids": ids, "source": prompts.source, "tokenizer": str(tok.path)}))
    return 0
