"""What deciding through `kvlab epp` costs: the ext_proc request phase as Envoy drives it (headers,
body in N chunks, until the pick comes back) against the scheduler's own time for the same requests.

    .venv/bin/python benchmarks/epp_pick.py [--requests 200] [--chunks 1,16]

Starts 3 `kvlab engine sim` replicas and one `kvlab epp` (kv-aware) as subprocesses on free ports,
then prints, per body chunking: the pick round trip over gRPC (p50/p95/p99, client side) next to the
EPP's `kvlab_gateway_routing_seconds` and `kvlab_gateway_tokenize_seconds` means over the same picks
(server side).
No request is forwarded: this is the picker's cost, not the replicas'.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from kvlab.lifecycle import terminate

KVLAB = [sys.executable, "-m", "kvlab.cli"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], ready: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv + ["--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{argv[3]} did not start")
        time.sleep(0.05)
    return proc


def _metric(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on the EPP's /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for key in total:
            if line.startswith(f"{name}_{key}"):
                total[key] += float(line.rsplit(" ", 1)[1])
    return total["sum"], total["count"]


def _mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    return (after[0] - before[0]) / max(after[1] - before[1], 1.0) * 1000


def _pick(stub: ext_proc_grpc.ExternalProcessorStub, body: bytes, chunks: int) -> float:
    q: queue.Queue[ext_proc.ProcessingRequest | None] = queue.Queue()
    replies = stub.Process(iter(q.get, None), timeout=30)
    mode = ProcessingMode.FULL_DUPLEX_STREAMED
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
                                          {":method": "POST", ":path": "/v1/chat/completions"}.items()])
    t0 = time.perf_counter()
    q.put(ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=headers),
                                     protocol_config=ext_proc.ProtocolConfiguration(request_body_mode=mode,
                                                                                    response_body_mode=mode)))
    step = -(-len(body) // chunks)
    for i in range(0, len(body), step):
        q.put(ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body[i:i + step],
                                                                        end_of_stream=i + step >= len(body))))
    first = next(replies)
    dt = time.perf_counter() - t0
    assert first.HasField("request_headers"), first
    q.put(None)
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--chunks", default="1,16")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-epp-bench-"))
    sim = _start([*KVLAB, "engine", "sim", "--replicas", "3", "--time-scale", "0.05"], tmp / "sim.json")
    procs = [sim]
    try:
        (tmp / "engines.json").write_text((tmp / "sim.json").read_text())
        port, mport = _port(), _port()
        procs.append(_start([*KVLAB, "epp", "--port", str(port), "--metrics-port", str(mport), "--policy", "kv-aware",
                             "--endpoints-file", str(tmp / "engines.json")], tmp / "epp.json"))
        stub = ext_proc_grpc.ExternalProcessorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        url = f"http://127.0.0.1:{mport}"
        time.sleep(1.0)    # first load-view scrape
        docs = ["\n".join(f"Doc {g} line {i}: alpha beta gamma delta {i * g}" for i in range(120)) for g in range(8)]
        print(f"# {platform_line()} · {a.requests} picks per row · 3 sim replicas · kv-aware")
        print(f"{'chunks':>6} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'schedule ms':>12} {'tokenize ms':>12}   (server: means)")
        for i in range(20):   # warm-up: tokenizer caches, first index lookups, gRPC channel
            _pick(stub, json.dumps({"model": "kvlab-tiny", "messages": [{"role": "user", "content": docs[i % 8]}]}).encode(), 1)
        for chunks in (int(c) for c in a.chunks.split(",")):
            names = ("kvlab_gateway_routing_seconds", "kvlab_gateway_tokenize_seconds")
            before = [_metric(url, n) for n in names]
            times = []
            for i in range(a.requests):
                body = json.dumps({"model": "kvlab-tiny", "max_tokens": 4, "messages": [
                    {"role": "system", "content": docs[i % len(docs)]}, {"role": "user", "content": f"q{i}"}]}).encode()
                times.append(_pick(stub, body, chunks) * 1000)
            times.sort()
            route, tok = (_mean_ms(b, _metric(url, n)) for b, n in zip(before, names))
            pct = [times[min(len(times) - 1, int(f * len(times)))] for f in (0.5, 0.95, 0.99)]
            print(f"{chunks:>6} {pct[0]:>8.2f} {pct[1]:>8.2f} {pct[2]:>8.2f} {route:>12.2f} {tok:>12.2f}")
    finally:
        for proc in reversed(procs):
            terminate(proc, 15)


def platform_line() -> str:
    import platform

    return f"{platform.machine()} · {os.cpu_count()} cores · python {platform.python_version()}"


if __name__ == "__main__":
    main()
