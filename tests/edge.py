"""Shared by the hardening, fuzz and fault tests: a simulator + gateway as subprocesses, a raw
HTTP client that sends exactly the bytes it is given (no client-side validation), and the sockets
a process tree listens on beyond loopback."""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvlab.contract import Endpoint
from kvlab.scenarios import faults


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict:
        """The OpenAI-shaped error object, asserting its shape."""
        assert self.headers.get("content-type", "").startswith("application/json"), (self.status, self.body[:200])
        err = json.loads(self.body)["error"]
        assert isinstance(err["message"], str) and err["code"] == self.status, err
        assert isinstance(err["type"], str)
        return err


def raw_request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                timeout: float = 30.0) -> Reply:
    """One HTTP/1.1 request on a fresh connection, bytes as given; the whole answer read."""
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    head += [f"{k}: {v}" for k, v in hdrs.items() if v is not None]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append(f"Content-Length: {len(body)}")
    data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
    raw = b"".join(chunks)
    head_raw, _, rest = raw.partition(b"\r\n\r\n")
    lines = head_raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    out = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        out[k.strip().lower()] = v.strip()
    if out.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return Reply(status, out, rest)


def _dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = data.index(b"\r\n", i)
        n = int(data[i:j].split(b";")[0], 16)
        if n == 0:
            return b"".join(out)
        out.append(data[j + 2:j + 2 + n])
        i = j + 2 + n + 2


@dataclass
class Stack:
    sim: subprocess.Popen
    replicas: list[Endpoint]
    gateway: subprocess.Popen
    gateway_port: int

    @property
    def sim_port(self) -> int:
        return int(self.replicas[0].url.rsplit(":", 1)[1])


@contextmanager
def sim_and_gateway(*sim_flags: str, config: dict | None = None) -> Iterator[Stack]:
    """One simulator process and a kv-aware gateway in front of it (kvlab.scenarios.faults)."""
    with tempfile.TemporaryDirectory() as d, faults.sim(Path(d), "sim", *sim_flags) as (sim, replicas), \
            faults.gateway(Path(d), replicas, config) as (gw, url):
        yield Stack(sim.proc, replicas, gw.proc, int(url.rsplit(":", 1)[1]))


def exposed_sockets(pids: dict[str, int]) -> list[str]:
    """'name pid process addr:port' for every listening TCP or bound UDP socket, not on loopback, of
    these processes and their children (vLLM's engine core); `pids` maps a name to a root pid."""
    out = []
    for name, pid in pids.items():
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
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
                    out.append(f"{name} {p.pid} {p.name()} {c.laddr.ip}:{c.laddr.port}")
    return out
