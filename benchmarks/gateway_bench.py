"""Gateway overhead figures, measured in one run (see docs/benchmarks.md, "Gateway").

    .venv/bin/python benchmarks/gateway_bench.py [--quick]

Prints: added latency (p50/p99) of the gateway vs calling the upstream directly; requests/s of
the gateway process pinned to one core; routing-decision time (hashing + index lookup + scoring)
for 512/2k/8k-token prompts, with tokenization (cold and warm) reported separately; tokenization
start-up/cold/warm cost for 8k-token completions and chats (`--tokenizer DIR` adds any HF
tokenizer, `--tokenization-only` runs just that part); KV-event
ingest rate (msgpack decode + index update); index memory for 1M blocks over 8 replicas; and the
throughput cost of 100 % trace sampling (OTLP export to a local receiver).

The upstream is a canned OpenAI-compatible responder (no model, no simulated latency), so the
figures are the gateway's own cost, not the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# ---- the canned upstream (also an OTLP sink) ---------------------------------------------------
def upstream_main(port: int) -> None:
    from aiohttp import web

    usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9,
             "prompt_tokens_details": {"cached_tokens": 0}}
    body = json.dumps({"id": "x", "object": "text_completion", "model": "m",
                       "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}], "usage": usage}).encode()
    metrics = (b'vllm:num_requests_waiting{model_name="m"} 0\nvllm:num_requests_running{model_name="m"} 0\n'
               b'vllm:kv_cache_usage_perc{model_name="m"} 0\n'
               b'vllm:cache_config_info{block_size="16",num_gpu_blocks="10000"} 1\n')

    async def complete(request):
        await request.read()
        return web.Response(body=body, content_type="application/json", headers={"x-kvlab-replica": "up"})

    async def otlp(request):
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/traces", otlp)
    app.router.add_get("/metrics", lambda r: web.Response(body=metrics))
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def wait_http(url: str, timeout: float = 30) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start_gateway(up_url: str, env_extra: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """The gateway is one single-threaded asyncio process: its req/s is what one core gives.
    (Not pinned: on a shared machine pinning lands it on a core other jobs already saturate.)"""
    port = free_port()
    env = {**os.environ, **env_extra}
    p = subprocess.Popen([PY, "-m", "kvlab.cli", "gateway", "--port", str(port), "--endpoints", f"up={up_url}",
                          "--policy", "kv-aware", "--log-level", "WARNING"],
                         env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/metrics")
    return p, url


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


async def latency(direct: str, via: str, n: int) -> tuple[list[float], list[float]]:
    import aiohttp

    payload = json.dumps({"model": "m", "prompt": "Say hello to the gateway benchmark.", "max_tokens": 1}).encode()
    hdr = {"Content-Type": "application/json"}
    d, g = [], []
    async with aiohttp.ClientSession() as s:
        for i in range(n + 50):
            for url, out in ((direct, d), (via, g)) if i % 2 else ((via, g), (direct, d)):
                t0 = time.perf_counter()
                async with s.post(url + "/v1/completions", data=payload, headers=hdr) as r:
                    await r.read()
                if i >= 50:   # warm-up
                    out.append((time.perf_counter() - t0) * 1000)
    return d, g


async def throughput(url: str, seconds: float, concurrency: int = 32) -> float:
    import aiohttp

    payload = json.dumps({"model": "m", "prompt": "Say hello to the gateway benchmark.", "max_tokens": 1}).encode()
    hdr = {"Content-Type": "application/json"}
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(s):
        nonlocal done
        while time.perf_counter() < stop_at:
            async with s.post(url + "/v1/completions", data=payload, headers=hdr) as r:
                await r.read()
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return done / seconds


def routing_figures(iters: int) -> list[tuple[int, float, float, float, float, float]]:
    from kvlab.contract import Endpoint
    from kvlab.gateway.config import load_policy
    from kvlab.gateway.endpoints import Registry
    from kvlab.gateway.router import Router
    from kvlab.gateway.scheduler import presets
    from kvlab.gateway.tokens import PromptTokenizer
    from kvlab.kvcache.events import BlockStored
    from kvlab.kvcache.hashing import block_keys
    from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
    from kvlab.tokenizer import words

    cfg = load_policy("kv-aware")
    reg = Registry()
    reg.update([Endpoint(name=f"r{i}", url=f"http://r{i}") for i in range(4)])
    for r in reg.replicas.values():
        r.events_state = "live"
        r.block_size = 16
    precise, approx = PreciseIndex(), ApproximateIndex()
    router = Router(cfg, reg, precise, approx, presets.build(cfg))
    tok = PromptTokenizer()
    vocab = words()
    rng = random.Random(0)
    out = []
    for target in (512, 2048, 8192):
        lines, text = [], ""
        while len(tok.tok.encode(text)) < target * 0.97:
            lines.append(" ".join(rng.choice(vocab) for _ in range(12)) + ".")
            text = "\n".join(lines)

        def msgs(q: str, system: str = text) -> list[dict[str, str]]:
            return [{"role": "system", "content": system}, {"role": "user", "content": q}]

        cold = []
        for i in range(5):
            fresh = PromptTokenizer(tok.tok)
            t0 = time.perf_counter()
            fresh.encode_chat(msgs(f"question {i}"))
            cold.append((time.perf_counter() - t0) * 1000)
        warm = []
        for i in range(iters):
            t0 = time.perf_counter()
            ids, _ = tok.encode_chat(msgs(f"question number {i} about {rng.choice(vocab)}"))
            warm.append((time.perf_counter() - t0) * 1000)
        # replica r1 holds the whole system prompt (precise index, as from its KV events)
        keys = block_keys(ids, 16)
        full = len(ids) // 16 * 16
        precise.apply("r1", [BlockStored(block_hashes=list(range(len(keys))), parent_block_hash=None,
                                         token_ids=ids[:full], block_size=16)])
        route = []
        for _ in range(iters):
            t0 = time.perf_counter()
            router.route(ids)
            route.append((time.perf_counter() - t0) * 1000)
        out.append((len(ids), statistics.median(cold), statistics.median(warm), pct(warm, 99),
                    statistics.median(route), pct(route, 99)))
    return out


def tokenization_figures(tokenizer: str | None, iters: int, target: int = 8192) -> dict[str, float]:
    """Cost of the gateway's tokenization path (transformers' tokenizer + template, piece cache)
    for a ~`target`-token prompt: start-up (a fresh process importing and loading it), cold
    (empty cache) and warm (shared document cached, a new question) for completions and chats."""
    from kvlab.gateway.tokens import PromptTokenizer
    from kvlab.tokenizer import Tokenizer, words

    code = ("import time; t = time.perf_counter(); from kvlab.gateway.tokens import PromptTokenizer; "
            "from kvlab.tokenizer import Tokenizer; PromptTokenizer(Tokenizer(%r)); print(time.perf_counter() - t)")
    startup = [float(subprocess.run([PY, "-c", code % tokenizer], capture_output=True, text=True, check=True,
                                    env={**os.environ, "PYTHONPATH": str(ROOT / "instrumentation")}).stdout)
               for _ in range(3)]
    tok = Tokenizer(tokenizer)
    rng = random.Random(3)
    vocab = words()
    lines: list[str] = []
    while len(tok.encode("\n".join(lines))) < target * 0.97:
        lines.append(" ".join(rng.choice(vocab) for _ in range(12)) + ".")
    doc = "\n".join(lines)
    chat = lambda q: [{"role": "system", "content": doc}, {"role": "user", "content": q}]  # noqa: E731
    out: dict[str, float] = {"startup_s": statistics.median(startup)}
    for kind, call in (("completion", lambda p, q: p.encode_text(doc + "\n" + q)),
                       ("chat", lambda p, q: p.encode_chat(chat(q)))):
        cold = []
        for i in range(5):
            fresh = PromptTokenizer(tok)
            t0 = time.perf_counter()
            ids, _ = call(fresh, f"question {i}")
            cold.append((time.perf_counter() - t0) * 1000)
        warm_tok = PromptTokenizer(tok)
        call(warm_tok, "first question")
        warm = []
        for i in range(iters):
            t0 = time.perf_counter()
            call(warm_tok, f"question number {i} about {rng.choice(vocab)}")
            warm.append((time.perf_counter() - t0) * 1000)
        out[f"{kind}_tokens"] = len(ids)
        out[f"{kind}_cold_p50"] = statistics.median(cold)
        out[f"{kind}_warm_p50"] = statistics.median(warm)
        out[f"{kind}_warm_p99"] = pct(warm, 99)
    return out


def print_tokenization(tokenizers: list[str | None], iters: int) -> None:
    print("tokenization (transformers tokenizer + template, gateway piece cache), ms:")
    print("  tokenizer | start-up s | kind | tokens | cold p50 | warm p50 / p99 (target 8k warm p99 <= 2 ms)")
    for t in tokenizers:
        f = tokenization_figures(t, iters)
        for kind in ("completion", "chat"):
            print(f"  {t or 'kvlab default'} | {f['startup_s']:.2f} | {kind} | {f[kind + '_tokens']:.0f} | "
                  f"{f[kind + '_cold_p50']:.2f} | {f[kind + '_warm_p50']:.3f} / {f[kind + '_warm_p99']:.3f}")


def ingest_rate(total_blocks: int) -> float:
    from kvlab.kvcache.events import BlockStored, KVEventBatch, decode_batch, encode_batch
    from kvlab.kvcache.index import PreciseIndex

    rng = random.Random(1)
    payloads = []
    n = 0
    eh = 1
    while n < total_blocks:
        events = []
        for _ in range(4):   # 4 events of 16 blocks per batch, each a new chain
            toks = [rng.randrange(2000) for _ in range(16 * 16)]
            events.append(BlockStored(block_hashes=list(range(eh, eh + 16)), parent_block_hash=None,
                                      token_ids=toks, block_size=16))
            eh += 16
            n += 16
        payloads.append(encode_batch(KVEventBatch(ts=0.0, events=events)))
    idx = PreciseIndex()
    t0 = time.perf_counter()
    for p in payloads:
        idx.apply("r0", decode_batch(p).events)
    return n / (time.perf_counter() - t0)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def index_memory(blocks: int, replicas: int) -> float:
    from kvlab.kvcache.events import BlockStored
    from kvlab.kvcache.index import PreciseIndex

    gc.collect()
    before = rss_mb()
    idx = PreciseIndex()
    per = blocks // replicas
    rng = random.Random(2)
    eh = 1
    for r in range(replicas):
        for _ in range(per // 64):   # chains of 64 blocks of 16 tokens
            toks = [rng.randrange(2000) for _ in range(64 * 16)]
            idx.apply(f"r{r}", [BlockStored(block_hashes=list(range(eh, eh + 64)), parent_block_hash=None,
                                            token_ids=toks, block_size=16)])
            eh += 64
    gc.collect()
    used = rss_mb() - before
    assert idx.total_blocks() >= blocks * 0.99
    return used


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", action="append", default=[],
                    help="also measure tokenization with this HF tokenizer directory (repeatable)")
    ap.add_argument("--tokenization-only", action="store_true", help="only the tokenization figures")
    args = ap.parse_args()
    if args.upstream:
        upstream_main(args.upstream)
        return 0
    if args.tokenization_only:
        print_tokenization([None, *args.tokenizer], 100 if args.quick else 300)
        return 0
    n = 300 if args.quick else 1000
    secs = 4.0 if args.quick else 8.0
    up_port = free_port()
    up = subprocess.Popen([PY, __file__, "--upstream", str(up_port)])
    procs = [up]
    try:
        up_url = f"http://127.0.0.1:{up_port}"
        wait_http(up_url + "/metrics")
        print(f"cores: {os.cpu_count()} (shared machine: figures are noisy)")
        # 1) added latency and 2) req/s, tracing off
        gw, gw_url = start_gateway(up_url, {"OTEL_TRACES_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "always_off"})
        procs.append(gw)
        d, g = asyncio.run(latency(up_url, gw_url, n))
        print(f"latency direct  p50 {pct(d, 50):.3f} ms  p99 {pct(d, 99):.3f} ms")
        print(f"latency gateway p50 {pct(g, 50):.3f} ms  p99 {pct(g, 99):.3f} ms")
        print(f"added latency   p50 {pct(g, 50) - pct(d, 50):.3f} ms  p99 {pct(g, 99) - pct(d, 99):.3f} ms"
              f"  (target <= 1 / <= 3 ms)")
        rps_direct = asyncio.run(throughput(up_url, secs))
        rps_off = asyncio.run(throughput(gw_url, secs))
        stop(gw)
        procs.remove(gw)
        print(f"throughput direct {rps_direct:.0f} req/s; via gateway (one process, one core) {rps_off:.0f} req/s (sampling off)")
        # 6) 100 % sampling: the cost of creating spans, then of exporting them (OTLP/HTTP protobuf)
        for label, env in [("spans created, not exported", {"OTEL_TRACES_EXPORTER": "none"}),
                           ("spans exported over OTLP/HTTP", {"OTEL_EXPORTER_OTLP_ENDPOINT": up_url})]:
            gw, gw_url = start_gateway(up_url, {**env, "OTEL_TRACES_SAMPLER": "always_on"})
            procs.append(gw)
            rps_on = asyncio.run(throughput(gw_url, secs))
            stop(gw)
            procs.remove(gw)
            print(f"100 % sampling, {label}: {rps_on:.0f} req/s, cost {100 * (1 - rps_on / rps_off):.1f} % "
                  f"(target <= 10 %)")
    finally:
        for p in procs:
            stop(p)
    # 3) routing decision
    print("routing decision (4 replicas, precise index, 16-token blocks), ms:")
    print("  prompt tokens | tokenize cold p50 | tokenize warm p50 / p99 | hash+lookup+score p50 / p99")
    for ntok, cold, w50, w99, r50, r99 in routing_figures(100 if args.quick else 300):
        print(f"  {ntok:13d} | {cold:17.2f} | {w50:10.3f} / {w99:.3f} | {r50:11.3f} / {r99:.3f}")
    print_tokenization([None, *args.tokenizer], 100 if args.quick else 300)
    # 4) ingest, 5) memory
    print(f"KV-event ingest (msgpack decode + index update, one core): "
          f"{ingest_rate(200_000 if args.quick else 1_000_000):,.0f} blocks/s (target >= 100,000)")
    print(f"precise index memory, 1M blocks over 8 replicas: {index_memory(1_000_000, 8):.0f} MB (target <= 300)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
