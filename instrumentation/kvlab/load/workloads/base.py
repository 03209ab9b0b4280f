"""What a workload is: a deterministic, endless stream of sessions of chat requests.

A *session* is a list of requests one Locust user sends in order (a multi-turn conversation has
several; the other workloads send one-request sessions). The stream depends only on the seed and
the parameters, so two lab phases replay exactly the same prompts in the same order.
Prompt text is made of kvlab's word list (about one token per word with kvlab's tokenizer) and
trimmed with the shared tokenizer to the requested token counts.
"""

from __future__ import annotations

import abc
import itertools
import random
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, ClassVar, Generic, TypeVar, cast

import msgspec

from kvlab.config import Strict, convert
from kvlab.tokenizer import Tokenizer, words


class WorkloadRequest(msgspec.Struct, kw_only=True, frozen=True):
    """One chat completion to send; `group` names the reuse unit (prefix group, session, document)."""

    messages: list[dict[str, str]]
    max_tokens: int
    group: str
    turn: int = 0
    headers: dict[str, str] = {}          # extra request headers (a priority class, a tenant)
    hint: str | None = None   # a client hint to the gateway (x-kvlab-kv-hint, docs/semantic-kv.md)
    pause_s: float = 0.0      # the client waits this long before sending it (an agent's tool call)


class Params(Strict, frozen=True):
    """Base of each workload's parameters."""

    output_tokens: int = 32


@lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    return Tokenizer()


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    return tuple(words())


def text(rng: random.Random, n_tokens: int) -> str:
    """About `n_tokens` tokens (never more) of words drawn with `rng`, deterministic for its state."""
    if n_tokens <= 0:
        return ""
    vocab = _vocabulary()
    chosen = [rng.choice(vocab) for _ in range(n_tokens)]
    tok = _tokenizer()
    while len(chosen) > 1:
        excess = len(tok.encode(" ".join(chosen))) - n_tokens
        if excess <= 0:
            break
        del chosen[-excess:]
    return " ".join(chosen)


WorkloadParams = Params   # the name inside Workload's body, where `Params` is the class attribute
P = TypeVar("P", bound=Params)


class Workload(abc.ABC, Generic[P]):
    """Base class: subclasses set `name`, `Params` (the class `P`) and implement `sessions`."""

    name: ClassVar[str]
    Params: ClassVar[type[WorkloadParams]] = WorkloadParams

    def __init__(self, seed: int = 0, params: dict[str, Any] | WorkloadParams | None = None) -> None:
        self.seed = seed
        given = params if isinstance(params, WorkloadParams) \
            else convert(params or {}, self.Params, f"workload {self.name}")
        self.params: P = cast(P, given)

    def rng(self, *key: object) -> random.Random:
        """A random generator determined by the seed, the workload and `key` (string seeding is stable)."""
        return random.Random(":".join(map(str, (self.seed, self.name, *key))))

    def texts(self, kind: str, count: int, tokens: int) -> list[str]:
        """`count` texts of `tokens` tokens each, determined by the seed and `kind` ("system",
        "document", ...): the shared parts prompts are built from, made once per workload."""
        cache: dict[tuple[str, int, int], list[str]] = self.__dict__.setdefault("_texts", {})
        key = (kind, count, tokens)
        if key not in cache:
            cache[key] = [text(self.rng(kind, i), tokens) for i in range(count)]
        return cache[key]

    @abc.abstractmethod
    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        """The endless, deterministic stream of sessions."""

    def requests(self, n: int) -> list[WorkloadRequest]:
        """The first `n` requests in stream order (sessions flattened); for tests and previews."""
        flat = (r for s in self.sessions() for r in s)
        return list(itertools.islice(flat, n))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "params": msgspec.to_builtins(self.params)}
