"""The policy's `chunked:` section (docs/chunked-decoding.md), parsed with the rest of the policy."""

from __future__ import annotations

from typing import Literal

from kvlab.config import Strict


class ChunkedSettings(Strict, frozen=True):
    chunk_tokens: int = 0                 # tokens per chunk; 0: off (a request may still ask by header)
    slots_per_replica: int = 4            # chunks running at once per replica
    reserved_slots: int = 1               # of those, kept for the best class (interactive requests)
    aging_s: float = 2.0                  # a waiting chunk's class improves by one per aging_s
    default_priority: Literal["high", "normal", "low"] = "normal"
