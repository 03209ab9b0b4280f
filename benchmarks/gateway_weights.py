"""Choose the kv-aware default weights by measurement on a shared-prefix workload.

    .venv/bin/python benchmarks/gateway_weights.py [--requests 120] [--concurrency 8]

Starts 4 simulator replicas (one process), then for each candidate policy/weight set runs the
same shared-prefix workload through an in-process gateway (prefix caches reset in between):
8 groups sharing a ~1,500-token system prompt, Zipf-ish popularity, a unique question each,
streamed, 16 output tokens. Prints mean/p90 TTFT seen by the client, the delivered hit rate
(cached/prompt tokens), and the busiest replica's share vs the mean. Figures go to docs/gateway.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from kvlab.gateway.config import Weights, load_policy
from kvlab.gateway.discovery.base import Endpoint, StaticDiscovery
from kvlab.gateway.server import Gateway
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names
from kvlab.tokenizer import words

CANDIDATES = [
    ("round-robin", None),
    ("least-load", None),
    ("kv-aware", Weights(prefix=1.0, queue=1.0, kv_usage=0.5, inflight=1.0)),
    ("kv-aware", Weights(prefix=3.0, queue=1.0, kv_usage=0.5, inflight=1.0)),
    ("kv-aware", Weights(prefix=10.0, queue=1.0, kv_usage=0.5, inflight=1.0)),
    ("kv-aware", Weights(prefix=3.0, queue=0.0, kv_usage=0.0, inflight=2.0)),
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    vocab = words()
    systems = ["\n".join(" ".join(rng.choice(vocab) for _ in range(12)) + "." for _ in range(110))
               for _ in range(8)]
    weights = [1 / (k + 1) for k in range(8)]
    return [(rng.choices(systems, weights)[0], f"question {i}: {rng.choice(vocab)} {rng.choice(vocab)}?")
            for i in range(n)]


async def run_policy(policy: str, weights: Weights | None, eps: list[Endpoint], reqs, concurrency: int):
    cfg = load_policy(policy)
    if weights is not None:
        cfg = msgspec.structs.replace(cfg, weights=weights)
    gw = Gateway(cfg, StaticDiscovery(eps), PromptTokenizer(), scrape_interval_ms=200)
    runner = web.AppRunner(gw.app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    ttfts, cached, prompt = [], 0, 0
    per: Counter = Counter()
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for e in eps:
            async with s.post(e.url + "/reset_prefix_cache"):
                pass
        await asyncio.sleep(1.0)   # first scrape, event streams connected

        async def one(system: str, q: str):
            nonlocal cached, prompt
            payload = {"model": "kvlab-tiny", "max_tokens": 16, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
            async with sem:
                t0 = time.perf_counter()
                first = None
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    per[r.headers[names.HEADER_ROUTED_TO]] += 1
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {") and b'"content"' in line:
                            first = time.perf_counter() - t0
                        if line.startswith(b"data: {") and b'"usage":{' in line.replace(b" ", b""):
                            u = json.loads(line[6:])["usage"]
                            if u:
                                cached += u["prompt_tokens_details"]["cached_tokens"]
                                prompt += u["prompt_tokens"]
                ttfts.append((first or 0) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(sy, q) for sy, q in reqs))
        wall = time.perf_counter() - t0
    await runner.cleanup()
    mean = sum(per.values()) / len(eps)
    return statistics.mean(ttfts), sorted(ttfts)[int(0.9 * len(ttfts))], cached / max(prompt, 1), \
        max(per.values()) / mean, len(reqs) / wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=0.5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        sim = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "engine", "sim", "--replicas", "4",
                                "--time-scale", str(args.time_scale), "--ready-file", str(ready)],
                               stdout=subprocess.DEVNULL, env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
        try:
            while not ready.exists():
                if sim.poll() is not None:
                    raise SystemExit("sim failed to start")
                time.sleep(0.1)
            eps = [Endpoint(**r) for r in json.loads(ready.read_text())["replicas"]]
            reqs = workload(args.requests)
            print(f"{args.requests} requests, concurrency {args.concurrency}, 4 sim replicas "
                  f"(cpu-tiny, time-scale {args.time_scale}), 8 shared-prefix groups")
            print(f"{'policy':<12} {'weights (prefix/queue/kv/inflight)':<36} {'TTFT mean':>9} {'p90':>8} "
                  f"{'hit rate':>8} {'max/mean':>8} {'req/s':>6}")
            for policy, w in CANDIDATES:
                mean, p90, hit, imb, rps = asyncio.run(run_policy(policy, w, eps, reqs, args.concurrency))
                ws = f"{w.prefix}/{w.queue}/{w.kv_usage}/{w.inflight}" if w else "preset"
                print(f"{policy:<12} {ws:<36} {mean:8.1f}ms {p90:6.1f}ms {hit:8.2f} {imb:8.2f} {rps:6.1f}",
                      flush=True)
        finally:
            sim.send_signal(signal.SIGTERM)
            sim.wait(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
