"""The command-line contract every engine keeps (`kvlab engine sim`, `kvlab engine vllm`), so the
local stack can start either one the same way and read the same ready JSON."""

from __future__ import annotations

import argparse

from kvlab.errors import ConfigError


def add_common(p: argparse.ArgumentParser, name: str, single_name: str = "") -> None:
    """The flags both engines take: replicas, addresses, names, model, tokenizer, ready file."""
    p.add_argument("--replicas", type=int, default=1, help="replicas to start")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (HTTP and KV events)")
    p.add_argument("--ports", help="HTTP ports, comma-separated (missing ones: free ports)")
    p.add_argument("--kv-events-ports", help="KV-event ZMQ ports, comma-separated (missing ones: free ports)")
    p.add_argument("--no-kv-events", action="store_true", help="publish no KV events")
    p.add_argument("--name", default=name, help=f"replicas are named NAME-0..NAME-(N-1){single_name}")
    p.add_argument("--model", default="kvlab-tiny", help="served model name")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer directory (default: kvlab's own)")
    p.add_argument("--ready-file", help="write the ready JSON here (atomically)")


def port_list(text: str | None, n: int, flag: str) -> list[int]:
    """`n` ports from a comma-separated flag; 0 where none was given (the caller picks a free one)."""
    try:
        ports = [int(p) for p in text.split(",") if p.strip()] if text else []
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated port numbers, got {text!r}") from None
    if len(ports) > n:
        raise ConfigError(f"{flag}: {len(ports)} ports for {n} replicas")
    return ports + [0] * (n - len(ports))
