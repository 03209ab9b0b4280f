"""A real vLLM replica (API server and engine core) SIGKILLed under streaming load: how many
requests fail and whether the resumed streams are whole (docs/reliability.md).

    .venv/bin/python benchmarks/replica_loss.py [--streams 8] [--max-tokens 96]

Two `kvlab engine vllm` replicas of the tiny model on CPU behind `kvlab gateway` (round-robin),
`--streams` greedy chat streams at once; once every stream has tokens, the replica serving more of
them is killed with its process group. Prints failed requests, resumes, and per resumed stream the
tokens it got (usage), its ids and finish reasons, and how much of its text equals the
uninterrupted greedy answer to the same prompt: all of the shorter of the two when nothing is
missing or repeated (the lengths may differ by a token where the text so far re-tokenizes into
fewer tokens than the replica generated, so the survivor generates one more). The simulator's run of the same fault is
`benchmarks/faults.py --only sigkill`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from kvlab.stack.launch import free_port
from kvlab.telemetry import names

MODEL = "kvlab-tiny"


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            return dict(json.loads(path.read_text()))
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        time.sleep(0.5)
    raise SystemExit(f"no {path} after {timeout} s")


def listener(port: int) -> int:
    """The pid of the process listening on `port`."""
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    raise SystemExit(f"nothing listens on {port}")


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any], opened: asyncio.Event) -> dict[str, Any]:
    out: dict[str, Any] = {"ok": False, "text": "", "ids": set(), "finishes": 0, "usage": None}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        out["replica"] = r.headers.get(names.HEADER_ROUTED_TO)
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: {"):
                    continue
                e = json.loads(ev[6:])
                if "error" in e:
                    out["error"] = e["error"]["message"]
                    continue
                out["ids"].add(e["id"])
                for c in e.get("choices") or []:
                    out["text"] += c["delta"].get("content") or ""
                    out["finishes"] += c.get("finish_reason") is not None
                    if out["text"]:
                        opened.set()
                out["usage"] = e.get("usage") or out["usage"]
        out["ok"] = r.status == 200 and "error" not in out and out["finishes"] == 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {len(os.sched_getaffinity(0))} CPUs; "
          f"vLLM on CPU, {MODEL}, {a.streams} streams, max_tokens {a.max_tokens}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        env = dict(os.environ, KVLAB_RUNS_DIR=str(d / "runs"), OTEL_TRACES_EXPORTER="none")
        kvlab = [sys.executable, "-m", "kvlab.cli"]
        procs = []
        try:
            engine = start([*kvlab, "engine", "vllm", "--replicas", "2", "--max-model-len", "2048",
                            "--kv-cache-gib", "1", "--log-dir", str(d / "logs"), "--ready-file", str(d / "ready.json")],
                           env, d / "engine.log")
            procs.append(engine)
            t0 = time.monotonic()
            ready = wait_file(d / "ready.json", engine, 900)
            print(f"replicas ready in {time.monotonic() - t0:.0f} s")
            port = free_port()
            gw = start([*kvlab, "gateway", "--port", str(port), "--endpoints-file", str(d / "ready.json"),
                        "--policy", "round-robin", "--model", MODEL, "--ready-file", str(d / "gateway.json")],
                       env, d / "gateway.log")
            procs.append(gw)
            wait_file(d / "gateway.json", gw, 60)
            url = f"http://127.0.0.1:{port}"
            ports = {r["name"]: int(r["url"].rsplit(":", 1)[1]) for r in ready["replicas"]}
            res = asyncio.run(run(url, ports, a.streams, a.max_tokens))
            print(json.dumps(res, indent=1))
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)


async def run(url: str, ports: dict[str, int], streams: int, max_tokens: int) -> dict[str, Any]:
    def body(i: int) -> dict[str, Any]:
        return {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                "messages": [{"role": "user", "content": f"Story {i}: tell me about the harbour and its ships."}]}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for _ in range(120):
            async with s.get(url + "/health") as h:
                if h.status == 200:
                    break
            await asyncio.sleep(0.5)
        # each replica's process group, found before any stream starts: scanning every process's
        # sockets takes seconds on a busy machine, long enough for the streams to end first
        groups = {name: os.getpgid(listener(port)) for name, port in ports.items()}
        opened = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(stream(s, url, body(i), e)) for i, e in enumerate(opened)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 300)
        eps = {r["name"]: r["load"]["inflight"]
               for r in (await (await s.get(url + "/debug/endpoints")).json())["replicas"]}
        victim = max(eps, key=lambda n: eps[n])
        os.killpg(groups[victim], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        # the uninterrupted greedy answers, from the survivor
        reference = [await stream(s, url, body(i), asyncio.Event()) for i in range(streams)]
        metrics = await (await s.get(url + "/metrics")).text()
    resumed = [(r, ref) for r, ref in zip(results, reference, strict=True) if r["replica"] == victim]

    def common(x: str, y: str) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))

    return {"streams": streams, "killed": victim, "in_flight_on_killed": eps[victim],
            "failed": sum(not r["ok"] for r in results),
            "resumes": sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                           if line.startswith(names.KVLAB_RESUMES + "_total{")),
            "resumed_streams": [{"completion_tokens": (r["usage"] or {}).get("completion_tokens"), "ids": len(r["ids"]),
                                 "finishes": r["finishes"], "chars": len(r["text"]),
                                 "uninterrupted_chars": len(ref["text"]),
                                 "same_as_uninterrupted_chars": common(r["text"], ref["text"])}
                                for r, ref in resumed]}


if __name__ == "__main__":
    main()
