"""`kvlab engine sim|vllm`: run a model server. Each backend parses its own flags."""

from __future__ import annotations

import importlib
import sys

BACKENDS = {
    "sim": ("kvlab.engine.sim.cli", "the vLLM-compatible simulator (N replicas in one process)"),
    "vllm": ("kvlab.engine.vllm", "real vLLM (CPU build) serving kvlab's tiny model"),
}


def _usage() -> str:
    lines = ["usage: kvlab engine <backend> [options]", "", "backends:"]
    lines += [f"  {name:<5} {help_}" for name, (_, help_) in BACKENDS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if argv[0] not in BACKENDS:
        print(f"kvlab engine: unknown backend {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(BACKENDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
