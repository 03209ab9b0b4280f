"""Choose the kv-aware scorers and weights by measurement, across every shipped workload.

    .venv/bin/python benchmarks/gateway_weights.py [--requests 96] [--concurrency 8] [--replicas 4]
        [--num-blocks 1024] [--workloads shared-prefix,agentic] [--json out.json]

Starts `--replicas` simulator replicas (cpu-tiny profile, one process), then for every shipped
workload (kvlab.load.workloads.NAMES, seed 0) and every candidate policy runs the same first
`--requests` requests through an in-process gateway, caches reset in between. Sessions (multi-turn,
agentic) are sent in order by `--concurrency` workers, like Locust users; every request is streamed
with a fixed output length. Per run: the delivered hit rate (cached / prompt tokens, from usage),
its share of the oracle hit rate (kvlab.load.oracle: Belady on one pooled cache of replicas x
num-blocks, computed for the order the requests actually arrived in), TTFT p50/p95 at the client,
throughput, errors. Prints one table per figure, candidates down, workloads across.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvlab.contract import Endpoint
from kvlab.gateway.config import PolicyConfig, load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
from kvlab.gateway.server import Gateway
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.load.measure import chat_body
from kvlab.load.oracle import ceiling, prompts
from kvlab.load.workloads import NAMES, WorkloadRequest, create

KV = {"prefix": 3.0, "queue": 1.0, "kv_usage": 0.5, "inflight": 1.0}   # kv-aware's weights before issue 17
# label -> (preset, weight overrides, speculative TTL override); explicit weights, so the tables in
# docs/benchmarks.md stay reproducible when the presets change
CANDIDATES: dict[str, tuple[str, dict[str, float] | None, float | None]] = {
    "round-robin": ("round-robin", None, None),
    "prefix": ("prefix", None, None),
    "kv-aware no-speculation": ("kv-aware", KV, 0.0),
    "kv-aware w/o predicted_ttft": ("kv-aware", KV, None),
    "kv-aware + pending_prefill 1": ("kv-aware", {**KV, "pending_prefill": 1.0}, None),
    "kv-aware + predicted_ttft 1": ("kv-aware", {**KV, "predicted_ttft": 1.0}, None),   # the preset now
    "prefix 3 + predicted_ttft 2": ("kv-aware", {"prefix": 3.0, "kv_usage": 0.5, "predicted_ttft": 2.0}, None),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def policy(label: str) -> PolicyConfig:
    preset, weights, ttl = CANDIDATES[label]
    cfg = load_policy(preset)
    if weights is not None:
        cfg = msgspec.structs.replace(cfg, weights=msgspec.convert(weights, type(cfg.weights)))
    if ttl is not None:
        cfg = msgspec.structs.replace(cfg, index=msgspec.structs.replace(cfg.index, speculative_ttl_s=ttl))
    return cfg


def sessions_of(workload: str, n: int) -> list[list[WorkloadRequest]]:
    """The first `n` requests of the workload's stream, kept in their sessions."""
    out: list[list[WorkloadRequest]] = []
    left = n
    for s in create(workload, seed=0).sessions():
        out.append(s[:left])
        left -= len(out[-1])
        if left <= 0:
            return out
    return out


@dataclass
class Run:
    ttfts: list[float] = field(default_factory=list)
    cached: int = 0
    prompt: int = 0
    errors: int = 0
    order: list[WorkloadRequest] = field(default_factory=list)   # arrival order, for the oracle
    wall_s: float = 0.0


async def run_policy(cfg: PolicyConfig, eps: list[Endpoint], sessions: list[list[WorkloadRequest]],
                     concurrency: int) -> Run:
    gw = Gateway(cfg, StaticDiscovery(eps), PromptTokenizer(), scrape_interval_ms=200)
    runner = web.AppRunner(gw.app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    run = Run()
    queue: asyncio.Queue[list[WorkloadRequest]] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for e in eps:
            async with http.post(e.url + "/reset_prefix_cache"):
                pass
        await asyncio.sleep(1.0)   # first scrape; the reset's AllBlocksCleared makes event streams live

        async def one(req: WorkloadRequest) -> None:
            run.order.append(req)
            t0 = time.perf_counter()
            first = None
            try:
                async with http.post(url, json=chat_body(req, "kvlab-tiny", 0)) as r:
                    if r.status != 200:
                        run.errors += 1
                        return
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {") and b'"content"' in line:
                            first = time.perf_counter() - t0
                        if line.startswith(b"data: {") and b'"usage":{' in line.replace(b" ", b""):
                            u = json.loads(line[6:])["usage"]
                            run.cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                            run.prompt += u["prompt_tokens"]
            except (TimeoutError, aiohttp.ClientError):
                run.errors += 1
                return
            if first is None:
                run.errors += 1
            else:
                run.ttfts.append(first * 1000)

        async def worker() -> None:
            while not queue.empty():
                for req in queue.get_nowait():
                    await one(req)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.wall_s = time.perf_counter() - t0
    await runner.cleanup()
    return run


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica (16 tokens each)")
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--workloads", default=",".join(NAMES))
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    labels = args.candidates.split(",")
    console = Console()
    results: dict[str, dict[str, dict[str, Any]]] = {label: {} for label in labels}
    tok = PromptTokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        sim = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "engine", "sim", "--replicas", str(args.replicas),
                                "--num-blocks", str(args.num_blocks), "--time-scale", str(args.time_scale),
                                "--ready-file", str(ready)],
                               stdout=subprocess.DEVNULL, env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
        try:
            while not ready.exists():
                if sim.poll() is not None:
                    raise SystemExit("sim failed to start")
                time.sleep(0.1)
            eps = [Endpoint(**r) for r in json.loads(ready.read_text())["replicas"]]
            console.print(f"{args.requests} requests per run, {args.concurrency} concurrent sessions, "
                          f"{args.replicas} sim replicas (cpu-tiny, {args.num_blocks} blocks of 16, "
                          f"time-scale {args.time_scale}), seed 0")
            with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=console) as progress:
                task = progress.add_task("runs", total=len(workloads) * len(labels))
                for w in workloads:
                    sessions = sessions_of(w, args.requests)
                    for label in labels:
                        progress.update(task, description=f"{w}: {label}")
                        run = asyncio.run(run_policy(policy(label), eps, sessions, args.concurrency))
                        orc = ceiling(prompts(run.order, 16, tok), 16, args.replicas * args.num_blocks)
                        hit = run.cached / max(run.prompt, 1)
                        results[label][w] = {
                            "hit_rate": hit, "oracle": orc.hit_rate, "share_of_oracle": hit / orc.hit_rate if orc.hit_rate else None,
                            "ttft_p50_ms": pct(run.ttfts, 0.5), "ttft_p95_ms": pct(run.ttfts, 0.95),
                            "req_per_s": len(run.ttfts) / run.wall_s, "errors": run.errors}
                        progress.advance(task)
        finally:
            sim.send_signal(signal.SIGTERM)
            sim.wait(15)
    figures = [("hit rate (share of oracle)", lambda r: f"{r['hit_rate']:.2f} ({r['share_of_oracle']:.0%})"
                if r["share_of_oracle"] is not None else f"{r['hit_rate']:.2f} (-)"),
               ("TTFT p50 ms", lambda r: f"{r['ttft_p50_ms']:.0f}"),
               ("TTFT p95 ms", lambda r: f"{r['ttft_p95_ms']:.0f}"),
               ("throughput req/s (errors)", lambda r: f"{r['req_per_s']:.1f}" + (f" ({r['errors']})" if r["errors"] else ""))]
    for title, cell in figures:
        table = Table(title=title)
        table.add_column("candidate")
        for w in workloads:
            table.add_column(w, justify="right")
        for label in labels:
            table.add_row(label, *(cell(results[label][w]) for w in workloads))
        console.print(table)
    oracle_row = {w: results[labels[0]][w]["oracle"] for w in workloads}
    console.print("oracle hit rate (first candidate's arrival order): "
                  + ", ".join(f"{w} {v:.2f}" for w, v in oracle_row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
