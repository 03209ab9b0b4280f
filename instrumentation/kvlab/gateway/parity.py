"""The tokenizer parity probe: does this replica cache the token ids the gateway hashes?

When a replica appears (at start-up and on every discovery change) the gateway tokenizes a fixed
completion prompt and a fixed chat locally and through the replica's `/tokenize`, with the
engine's defaults (BOS for the prompt, the template for the chat). A difference means every
block key the precise index computes for that replica is wrong, so precise predictions would be
a silent zero: the replica is marked `tokenizer-mismatch` (in `/debug/endpoints`, `/health`, the
`kvlab_gateway_tokenizer_parity` gauge, a span event and one log line naming the first differing
position) and the router looks it up in the approximate index instead, the same fallback a
replica with a stale event stream gets. An engine without `/tokenize` leaves it `unverified`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from opentelemetry import trace

from kvlab.errors import RequestError
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names

log = logging.getLogger(__name__)

MATCH, MISMATCH, UNVERIFIED = "match", "tokenizer-mismatch", "unverified"
PROMPT = "Parity probe: the quick brown fox jumps over 13 lazy dogs.\nThen it rests; done!"
CHAT = [{"role": "user", "content": "Parity probe: hello there."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Count to three.\nThen stop."}]


@dataclass(slots=True)
class Verdict:
    state: str
    detail: str = ""
    sample: str | None = None         # "completion" | "chat"
    position: int | None = None       # first differing token position
    local: int | None = None          # the gateway's id there (None: its sequence ended)
    remote: int | None = None         # the replica's id there


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(sample: str, local: list[int], remote: list[int]) -> Verdict:
    pos = first_difference(local, remote)
    if pos is None:
        return Verdict(MATCH, f"{sample} sample: {len(local)} ids identical", sample)
    mine = local[pos] if pos < len(local) else None
    theirs = remote[pos] if pos < len(remote) else None
    return Verdict(MISMATCH, f"{sample} sample differs at token {pos}: gateway id {mine}, replica id {theirs} "
                   f"({len(local)} vs {len(remote)} ids)", sample, pos, mine, theirs)


class ParityProbe:
    """Runs one probe task per new replica; `on_verdict` updates the gateway's metrics."""

    def __init__(self, prompts: PromptTokenizer, model: str | None = None, attempts: int = 30,
                 retry_s: float = 1.0, on_verdict: Callable[[Backend, Verdict], None] | None = None) -> None:
        self.prompts = prompts
        self.model = model
        self.attempts = attempts
        self.retry_s = retry_s
        self.on_verdict = on_verdict
        self.session: aiohttp.ClientSession | None = None
        self.tracer = trace.get_tracer("kvlab.gateway")
        self._tasks: dict[str, asyncio.Task[None]] = {}
        local_prompt, _ = prompts.encode_text(PROMPT, True)
        self._samples: list[tuple[str, dict[str, Any], list[int]]] = [("completion", {"prompt": PROMPT}, local_prompt)]
        if prompts.tok.hf.chat_template is not None:
            try:
                self._samples.append(("chat", {"messages": CHAT}, prompts.encode_chat(CHAT)[0]))
            except RequestError as exc:   # a template that rejects the sample: probe completions only
                log.info("tokenizer parity probe: chat sample skipped: %s", exc.message)

    def start(self, r: Backend) -> None:
        self.stop(r.name)
        self._tasks[r.name] = asyncio.create_task(self._run(r))

    def stop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, r: Backend) -> None:
        try:
            verdict = await self.check(r)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the probe never takes the gateway down
            verdict = Verdict(UNVERIFIED, f"probe failed: {type(exc).__name__}: {exc}")
        r.tokenizer, r.tokenizer_detail = verdict.state, verdict.detail
        with self.tracer.start_as_current_span(names.SPAN_TOKENIZER_PROBE) as span:
            span.set_attribute(names.REPLICA, r.name)
            span.set_attribute(names.TOKENIZER_STATE, verdict.state)
            if verdict.state == MISMATCH:
                span.add_event(names.EVENT_TOKENIZER_MISMATCH, {
                    names.TOKENIZER_SAMPLE: verdict.sample or "",
                    names.TOKENIZER_FIRST_DIFFERENCE: verdict.position if verdict.position is not None else -1,
                    names.TOKENIZER_LOCAL_ID: -1 if verdict.local is None else verdict.local,
                    names.TOKENIZER_REPLICA_ID: -1 if verdict.remote is None else verdict.remote})
        if verdict.state == MISMATCH:
            log.warning("tokenizer mismatch on %s: %s; routing it with the approximate index "
                        "(check `kvlab tokenize` against the engine's /tokenize, docs/gateway.md)",
                        r.name, verdict.detail)
        else:
            log.info("tokenizer parity of %s: %s (%s)", r.name, verdict.state, verdict.detail)
        if self.on_verdict is not None:
            self.on_verdict(r, verdict)
        self._tasks.pop(r.name, None)

    async def check(self, r: Backend) -> Verdict:
        """Compare every sample with the replica's `/tokenize` (retried while it starts)."""
        assert self.session is not None, "set .session first"
        for sample, body, local in self._samples:
            remote = await self._tokenize(r, {**body, **({"model": self.model} if self.model else {})})
            if remote is None:
                return Verdict(UNVERIFIED, f"{r.url}/tokenize is not available")
            verdict = compare(sample, local, remote)
            if verdict.state != MATCH:
                return verdict
        return Verdict(MATCH, " and ".join(s for s, _, _ in self._samples) + " samples identical")

    async def _tokenize(self, r: Backend, body: dict[str, Any]) -> list[int] | None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=10)
        for attempt in range(self.attempts):
            try:
                async with self.session.post(r.url + "/tokenize", data=msgspec.json.encode(body), timeout=timeout,
                                             headers={"Content-Type": "application/json"}) as resp:
                    if resp.status in (404, 405, 501):
                        return None
                    if resp.status == 200:
                        data = msgspec.json.decode(await resp.read())
                        if isinstance(data, dict) and isinstance(data.get("tokens"), list):
                            tokens: list[int] = data["tokens"]
                            return tokens
                    error = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < self.attempts:
                await asyncio.sleep(self.retry_s)
        raise RuntimeError(f"{r.url}/tokenize kept failing: {error}")
