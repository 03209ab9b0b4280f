"""Timing requests against an engine on a grid: TTFT by prompt length x cached fraction, ITL by batch.

TTFT is the time to the first streamed chunk carrying a choice (kvlab's tokenizer makes every id
visible text, so it is also the first non-empty token). Prompts are random visible token ids; the
cached part is primed by a request for exactly that prefix and checked against `cached_tokens`.
ITL is (last token - first token) / (tokens - 1) per request, median over the batch: SSE chunks
may carry several tokens when the client lags, so tokens are counted, not chunks.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import aiohttp

from kvlab.errors import StackError
from kvlab.lifecycle import terminate
from kvlab.process import Child
from kvlab.tokenizer import Tokenizer

KVLAB = [sys.executable, "-m", "kvlab.cli"]
Rows = list[dict[str, Any]]


class Streamed(TypedDict):
    """One streamed completion as `stream` measured it."""

    ttft_ms: float
    times: list[float]       # seconds from the request to each token
    cached: int              # the engine's `cached_tokens`


def start_engine(args: list[str], log: Path, timeout_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """`kvlab engine ARGS` in its own session; (process, URL of its first replica) once ready."""
    ready = log.with_suffix(".ready.json")
    ready.unlink(missing_ok=True)
    proc = Child.start("engine", [*KVLAB, "engine", *args, "--ready-file", str(ready)], log).popen
    deadline = time.monotonic() + timeout_s
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate(proc, 30)
            raise StackError(f"`kvlab engine {args[0]}` did not start in {timeout_s:.0f} s; see {log}")
        time.sleep(0.5)
    url: str = json.loads(ready.read_text())["replicas"][0]["url"]
    return proc, url


def cached_tokens(n: int, fraction: float, block_size: int) -> int:
    """The block-aligned cached prefix for a fraction (vLLM caches whole blocks, never the last token)."""
    return min(int(n * fraction) // block_size * block_size, (n - 1) // block_size * block_size)


async def stream(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> Streamed:
    """One streamed completion: TTFT, the times of its tokens, and `cached_tokens`.

    A pooled connection left idle while the other engine was measured can be closed by the server
    (uvicorn's 5-s keep-alive) just as it is reused: that send is made once more on a new
    connection, timed afresh. Any other client error is a StackError naming the engine."""
    try:
        try:
            return await _stream(client, url, model, prompt, max_tokens)
        except aiohttp.ServerDisconnectedError:
            return await _stream(client, url, model, prompt, max_tokens)
    except aiohttp.ClientError as exc:
        raise StackError(f"{url}: {type(exc).__name__}: {exc} (is the engine still up? see its log)") from None


async def _stream(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> Streamed:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] = {}
    async with client.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise StackError(f"{url}: HTTP {r.status}: {(await r.read())[:300]!r}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices"):
                times.append(time.perf_counter() - t0)
            if d.get("usage"):
                usage = d["usage"]
    if not times:
        raise StackError(f"{url}: a streamed completion carried no token")
    cached: int = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_ms": times[0] * 1000, "times": times, "cached": cached}


class Grid:
    """The points to measure and how (what `kvlab calibrate` and its report share)."""

    def __init__(self, lengths: list[int], fractions: list[float], batches: list[int], block_size: int = 128,
                 model: str = "kvlab-tiny", itl_prompt: int = 64, itl_tokens: int = 48) -> None:
        self.lengths, self.fractions, self.batches = lengths, fractions, batches
        self.block_size, self.model = block_size, model
        self.itl_prompt, self.itl_tokens = itl_prompt, itl_tokens

    def size(self) -> int:
        return len(self.lengths) * len(self.fractions) + len(self.batches)

    async def ttft(self, client: aiohttp.ClientSession, url: str, n: int, cached: int, rng: random.Random,
                   visible: list[int]) -> dict[str, Any]:
        prompt = [rng.choice(visible) for _ in range(n)]
        if cached:
            await stream(client, url, self.model, prompt[:cached], 1)       # prime exactly `cached` tokens
        res = await stream(client, url, self.model, prompt, 1)
        return {"n": n, "cached": res["cached"], "primed": cached, "ttft_ms": res["ttft_ms"]}

    async def itl(self, client: aiohttp.ClientSession, url: str, batch: int, rng: random.Random,
                  visible: list[int]) -> dict[str, Any]:
        prompts = [[rng.choice(visible) for _ in range(self.itl_prompt)] for _ in range(batch)]
        results = await asyncio.gather(*(stream(client, url, self.model, p, self.itl_tokens) for p in prompts))
        itls = [(r["times"][-1] - r["times"][0]) * 1000 / (self.itl_tokens - 1) for r in results]
        return {"batch": batch, "itl_ms": statistics.median(itls)}

    async def measure(self, targets: dict[str, str], reps: int, seed: int,
                      advance: Callable[[str], None] = lambda _: None) -> dict[str, dict[str, Rows]]:
        """Every point for every target, interleaved point by point (the target order alternates per
        repeat) so all see the same machine load. `advance` is called after each point."""
        visible = Tokenizer().visible_ids
        rng = random.Random(seed)
        out: dict[str, dict[str, Rows]] = {name: {"ttft": [], "itl": []} for name in targets}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
            for rep in range(reps):
                order = list(targets) if rep % 2 == 0 else list(targets)[::-1]
                for n in self.lengths:
                    for f in self.fractions:
                        c = cached_tokens(n, f, self.block_size)
                        for name in order:
                            p = await self.ttft(client, targets[name], n, c, rng, visible)
                            out[name]["ttft"].append({**p, "fraction": f, "rep": rep})
                        advance(f"rep {rep + 1}/{reps}: TTFT n={n} cached={c}")
                for b in self.batches:
                    for name in order:
                        out[name]["itl"].append({**await self.itl(client, targets[name], b, rng, visible), "rep": rep})
                    advance(f"rep {rep + 1}/{reps}: ITL batch {b}")
        return out


def medians(rows: Rows, key: tuple[str, ...], value: str) -> dict[tuple[Any, ...], float]:
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r[value])
    return {k: statistics.median(v) for k, v in groups.items()}


def spread(rows: Rows, key: tuple[str, ...], value: str) -> float:
    """Median over points of (max - min) / median across repeats: how noisy the machine was."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r[value])
    rel = [(max(v) - min(v)) / statistics.median(v) for v in groups.values() if len(v) > 1]
    return statistics.median(rel) if rel else 0.0
