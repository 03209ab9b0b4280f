"""How many requests/s can one simulator process serve before its own overhead inflates TTFT > 5 %?

Starts `kvlab engine sim --replicas 4` pinned to one core and drives it from this process (pinned
to another core) with open-loop Poisson arrivals, round-robin over the replicas, each request a
unique ~128-token text prompt with 32 streamed output tokens. For every rate, the ideal TTFT is
obtained by replaying the very same arrivals (per replica, same prompts, same scheduler and
profile) in virtual time, so queueing and batching that the latency model itself predicts are not
counted as overhead. overhead = mean measured TTFT - mean ideal TTFT: a fixed part (the loopback
HTTP round trip and the client's own parsing, which a real vLLM server costs too, taken at the
lowest rate) and the part that grows with load (the simulator falling behind). The sustained rate
is the highest served rate up to which that growth stays within 5 % of the ideal TTFT at every
rate tried. The client measures TTFT as the first body bytes of the stream (the simulator sends
nothing before the first token); "engine ms" is the replicas' own histogram (no HTTP).

    .venv/bin/python benchmarks/sim_throughput.py [--profile cpu-tiny] [--time-scale 0.5] [--rates 50,100,...] [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.profile import get_profile
from kvlab.engine.sim.scheduler import Request, Scheduler
from kvlab.tokenizer import Tokenizer, words

REPLICAS = 4
OUTPUT_TOKENS = 32


def start_sim(profile: str, time_scale: float, cpu: int | None) -> tuple[subprocess.Popen, list[dict]]:
    ready = Path(tempfile.mkdtemp()) / "ready.json"
    cmd = [sys.executable, "-m", "kvlab.cli", "engine", "sim", "--replicas", str(REPLICAS),
           "--profile", profile, "--time-scale", str(time_scale), "--no-kv-events", "--ready-file", str(ready)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
    for _ in range(600):
        if ready.exists():
            return proc, json.loads(ready.read_text())["replicas"]
        if proc.poll() is not None:
            raise SystemExit("simulator failed to start")
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("simulator not ready after 30 s")


def engine_ttft(replicas: list[dict]) -> tuple[float, float]:
    """Sum and count of the replicas' own TTFT histograms (submit to first token, no HTTP)."""
    import urllib.request

    total = count = 0.0
    for r in replicas:
        for line in urllib.request.urlopen(r["url"] + "/metrics").read().decode().splitlines():
            if line.startswith("vllm:time_to_first_token_seconds_sum"):
                total += float(line.split()[-1])
            elif line.startswith("vllm:time_to_first_token_seconds_count"):
                count += float(line.split()[-1])
    return total, count


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(session: aiohttp.ClientSession, url: str, prompt: str, t0: float, out: list) -> None:
    sent = time.perf_counter()
    body = {"model": "kvlab-tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
            "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            await resp.content.readany()
            ttft = time.perf_counter() - sent
            async for _ in resp.content.iter_any():
                pass
        out.append((sent - t0, url, prompt, ttft, time.perf_counter() - sent, resp.status))
    except aiohttp.ClientError as exc:
        out.append((sent - t0, url, prompt, None, None, str(exc)))


async def load(replicas: list[dict], rate: float, seconds: float, seed: int) -> tuple[list, float]:
    rng = random.Random(seed)
    vocab = words()
    urls = [r["url"] for r in replicas]
    out: list = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        tasks, t, i = [], 0.0, 0
        while t < seconds:
            prompt = " ".join(rng.choice(vocab) for _ in range(120))
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, urls[i % len(urls)], prompt, t0, out)))
            i += 1
            t += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return out, elapsed


def ideal_ttfts(arrivals: list[tuple[float, list[int]]], profile: str, time_scale: float) -> list[float]:
    """Replay one replica's arrivals through the same scheduler in virtual time (no overhead)."""
    prof = get_profile(profile)
    sched = Scheduler(BlockPool(prof.num_blocks, prof.block_size, events=False), prof.max_num_seqs,
                      prof.max_num_batched_tokens)
    reqs, first = [], {}
    i, t = 0, 0.0
    while i < len(arrivals) or sched.has_work():
        if not sched.has_work():
            t = max(t, arrivals[i][0])
        while i < len(arrivals) and arrivals[i][0] <= t:
            ids = arrivals[i][1]
            r = Request(str(i), ids, [5] * OUTPUT_TOKENS, sched.prompt_keys(ids))
            r.t_arrival = arrivals[i][0]
            reqs.append(r)
            sched.add(r)
            i += 1
        batch = sched.schedule()
        t += prof.step_ms(batch.prefill_tokens, batch.decode_seqs) * time_scale / 1000
        for r in sched.complete(batch):
            if r.num_output == 1:
                first[r.id] = t - r.t_arrival
    return [first[r.id] for r in reqs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--rates", default="25,50,100,150,200")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--profile", default="cpu-tiny", help="latency profile (the modelled engine's capacity caps the rate)")
    ap.add_argument("--threshold", type=float, default=0.05)
    args = ap.parse_args()
    ncpu = os.cpu_count() or 1
    sim_cpu = 0 if ncpu >= 2 else None
    if sim_cpu is not None:
        os.sched_setaffinity(0, {1})
    tok = Tokenizer()
    proc, replicas = start_sim(args.profile, args.time_scale, sim_cpu)
    print(f"simulator: {REPLICAS} replicas, pid {proc.pid}, cpu {sim_cpu}, profile {args.profile}, time scale {args.time_scale}; "
          f"{OUTPUT_TOKENS} streamed tokens per request, ~128-token unique prompts")
    print(f"{'offered':>8} {'served':>8} {'ok':>6} {'ttft ms':>8} {'engine ms':>9} {'ideal ms':>8} "
          f"{'overhead':>9} {'growth':>7} {'sim cpu':>8} {'cpu ms/req':>10}")
    best, base, passing = 0.0, None, True
    try:
        asyncio.run(load(replicas, 20, 1.0, 0))  # warm-up
        for k, rate in enumerate(float(r) for r in args.rates.split(",")):
            c0, e0 = cpu_seconds(proc.pid), engine_ttft(replicas)
            out, elapsed = asyncio.run(load(replicas, rate, args.seconds, k + 1))
            cpu = (cpu_seconds(proc.pid) - c0) / elapsed
            e1 = engine_ttft(replicas)
            eng = (e1[0] - e0[0]) / max(1.0, e1[1] - e0[1])
            ok = [o for o in out if o[5] == 200]
            measured, ideal = [], []
            for url in {o[1] for o in ok}:
                mine = sorted((o for o in ok if o[1] == url), key=lambda o: o[0])
                measured += [o[3] for o in mine]
                ideal += ideal_ttfts([(o[0], tok.encode(o[2])) for o in mine], args.profile, args.time_scale)
            m, i = sum(measured) / len(measured), sum(ideal) / len(ideal)
            served = len(ok) / elapsed
            overhead = m - i
            base = overhead if base is None else base
            growth = (overhead - base) / i
            print(f"{rate:8.0f} {served:8.1f} {len(ok) / len(out):6.0%} {m * 1e3:8.2f} {eng * 1e3:9.2f} {i * 1e3:8.2f} "
                  f"{overhead * 1e3:7.2f}ms {growth:7.1%} {cpu:8.0%} {cpu * elapsed / max(1, len(out)) * 1e3:10.2f}",
                  flush=True)
            passing = passing and growth <= args.threshold and len(ok) == len(out)
            if passing:
                best = max(best, served)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    print(f"\nfixed overhead (loopback HTTP + client) {base * 1e3 if base is not None else float('nan'):.2f} ms; "
          f"max sustained rate with load-driven TTFT growth <= {args.threshold:.0%}: {best:.0f} requests/s "
          f"({REPLICAS} replicas, one core, {OUTPUT_TOKENS} streamed tokens each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
