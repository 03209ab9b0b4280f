"""The desired-replica recommendation (gateway/autoscale.py) and the local stack acting on it
(stack/scaler.py): it rises under a load ramp, falls after it, and scaling actions are spans."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import free_port
from kvlab.contract import Endpoint
from kvlab.gateway.autoscale import AutoscaleSettings, Recommender
from kvlab.gateway.discovery.file import FileDiscovery, write_endpoints
from kvlab.gateway.endpoints import Backend
from kvlab.stack.scaler import Scaler
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exp))
    return exp


def _pool(n: int, waiting: float, kv: float = 0.1, dp: int = 1) -> list[Backend]:
    return [Backend(Endpoint(name=f"r{i}-dp{r}", url=f"http://x/{i}/{r}", dp_rank=r if dp > 1 else None,
                             replica=f"r{i}" if dp > 1 else None), waiting=waiting / dp, kv_usage=kv)
            for i in range(n) for r in range(dp)]


def test_recommendation_rises_under_a_ramp_and_falls_after_the_window():
    rec = Recommender(AutoscaleSettings(target_waiting=2, target_kv_usage=0.7, scale_down_window_s=10,
                                        max_replicas=6))
    seen, current, t = [], 1, 0.0
    ramp = [0, 1, 2, 4, 8, 12, 12, 6, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    for total_waiting in ramp:    # total queue across the pool; the pool follows the recommendation
        r = rec.observe(_pool(current, total_waiting / current, dp=2), now=t)
        seen.append(r.desired)
        current, t = r.desired, t + 2.0
    peak = seen.index(max(seen))
    assert max(seen) >= 4 and seen[0] == 1
    assert all(a <= b for a, b in zip(seen[:peak], seen[1:peak + 1]))   # rises with the ramp
    assert seen[-1] == 1                                                # falls after it
    # ... but not before the window has passed: the first drop comes >= 10 s after the peak load
    first_drop = next(i for i in range(peak, len(seen)) if seen[i] < max(seen))
    assert (first_drop - ramp.index(12)) * 2.0 >= 10
    # KV pressure alone scales up too; within tolerance nothing moves
    assert Recommender().observe(_pool(2, 0, kv=0.98)).desired == 3
    assert Recommender().observe(_pool(2, 2.1)).reason == "hold:tolerance"


def test_file_discovery_follows_rewrites(tmp_path):
    path = tmp_path / "endpoints.json"
    a, b = Endpoint(name="a", url="http://a"), Endpoint(name="b", url="http://b", dp_rank=0, replica="rb")
    write_endpoints(path, [a])
    seen: list[list[Endpoint]] = []

    async def main():
        async def on_change(eps):
            seen.append(eps)
        task = asyncio.create_task(FileDiscovery(path, interval_s=0.02).run(on_change))
        await asyncio.sleep(0.1)
        write_endpoints(path, [a, b])
        await asyncio.sleep(0.1)
        path.write_text("{half")       # a broken file keeps the last good set
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    assert seen == [[a], [a, b]]   # the broken file announced nothing


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_stack_scales_up_under_load_and_down_after_it(tmp_path, exporter):
    exporter.clear()
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
    sim_args = ["--time-scale", "1", "--max-num-seqs", "2", "--no-kv-events"]
    kvlab = [sys.executable, "-m", "kvlab.cli"]
    ready = tmp_path / "ready-sim.json"
    endpoints = tmp_path / "endpoints.json"
    procs: list[subprocess.Popen] = []
    scaler = None
    try:
        procs.append(subprocess.Popen([*kvlab, "engine", "sim", "--name", "base", "--ready-file", str(ready), *sim_args],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        _wait(ready.exists, 30, "the simulator")
        endpoints.write_text(ready.read_text())
        (tmp_path / "policy.yaml").write_text("autoscale: {target_waiting: 1, scale_down_window_s: 2, max_replicas: 2}\n")
        port = free_port()
        procs.append(subprocess.Popen([*kvlab, "gateway", "--port", str(port), "--policy", "kv-aware",
                                       "--config", str(tmp_path / "policy.yaml"), "--discovery", "file",
                                       "--endpoints-file", str(endpoints), "--scrape-interval-ms", "100"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _up(url), 30, "the gateway")
        scaler = Scaler(url, endpoints, lambda name, r: [*kvlab, "engine", "sim", "--name", name, "--ready-file", str(r), *sim_args],
                        tmp_path, env=env, drain_s=0.5)

        stop = threading.Event()

        def user(i: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                while not stop.is_set():
                    c.post("/v1/completions", json={"model": "kvlab-tiny", "prompt": f"user {i} " * 300, "max_tokens": 24})

        users = [threading.Thread(target=user, args=(i,)) for i in range(8)]
        for u in users:
            u.start()
        try:
            _wait(lambda: (scaler.recommendation() or {}).get("desired", 0) >= 2, 30, "a scale-up recommendation")
            assert scaler.step() == "up"
            assert scaler.current() == 2
            _wait(lambda: len(httpx.get(url + "/debug/endpoints").json()["replicas"]) == 2,
                  10, "the gateway to see the new replica")
        finally:
            stop.set()
            for u in users:
                u.join()
        _wait(lambda: (scaler.recommendation() or {}).get("desired") == 1, 30, "the recommendation to fall")
        assert scaler.step() == "down"
        assert scaler.current() == 1
        metrics = httpx.get(url + "/metrics").text
        assert names.KVLAB_DESIRED_REPLICAS in metrics
    finally:
        if scaler is not None:
            scaler.stop()
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=15)
    spans = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_SCALE_ACTION]
    assert [s.attributes[names.SCALE_DIRECTION] for s in spans] == ["up", "down"]
    assert spans[0].attributes[names.SCALE_TO] == 2 and spans[1].attributes[names.SCALE_TO] == 1
    assert spans[0].attributes[names.SCALE_READY_MS] > 0


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
