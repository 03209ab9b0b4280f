"""Fault scenarios against real `kvlab engine sim` and `kvlab gateway` processes, each returning its figures.

Used by tests/test_faults.py (which asserts the properties at a small size) and by
benchmarks/faults.py (which prints the figures docs/reliability.md quotes). Every process is a
`Child` started on free loopback ports and stopped by its pid; `run_dir` holds their logs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvlab.contract import Endpoint
from kvlab.process import Child
from kvlab.stack.launch import HOST, KVLAB, free_port, gateway_args, sim_argv
from kvlab.telemetry import names
from kvlab.topology import GatewaySettings

NO_TRACES = {"OTEL_TRACES_EXPORTER": "none"}


@contextmanager
def sim(run_dir: Path, name: str, *flags: str, env: dict[str, str] | None = None) -> Iterator[tuple[Child, list[Endpoint]]]:
    """`kvlab engine sim --name NAME FLAGS` on loopback; yields (child, its replicas from the ready JSON)."""
    ready = run_dir / f"ready-{name}.json"
    ready.unlink(missing_ok=True)
    child = Child.start(name, sim_argv(name, ready, flags), run_dir / f"{name}.log", {**os.environ, **(env or NO_TRACES)})
    try:
        yield child, msgspec.convert(child.wait_ready_file(ready, 60)["replicas"], list[Endpoint])
    finally:
        child.stop()


@contextmanager
def gateway(run_dir: Path, replicas: list[Endpoint], config: dict[str, Any] | None = None, policy: str = "kv-aware",
            env: dict[str, str] | None = None) -> Iterator[tuple[Child, str]]:
    """`kvlab gateway` over `replicas` with an optional policy override; yields (child, its URL)."""
    port = free_port()
    eps = run_dir / f"endpoints-{port}.json"
    eps.write_bytes(msgspec.json.encode({"replicas": replicas}))
    ready = run_dir / f"ready-gateway-{port}.json"
    cfg = run_dir / f"gateway-policy-{port}.json"
    if config:
        cfg.write_text(json.dumps(config))
    argv = [*KVLAB, *gateway_args(GatewaySettings(scrape_interval_ms=200), policy=policy, model=None, host=HOST,
                                  port=port, config=str(cfg) if config else None),
            "--endpoints-file", str(eps), "--ready-file", str(ready)]
    child = Child.start("gateway", argv, run_dir / f"gateway-{port}.log", {**os.environ, **(env or NO_TRACES)})
    try:
        child.wait_ready_file(ready, 60)
        url = f"http://{HOST}:{port}"
        child.wait_http(url + "/health", 30)
        yield child, url
    finally:
        child.stop()


class BlackHole:
    """A TCP server that accepts connections and never answers (a hung replica or trace backend).
    `requests` counts the connections on which a request line arrived."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(1024)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.requests: list[bytes] = []
        self._conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        try:
            first = conn.recv(65536)
            if first:
                self.requests.append(first.split(b"\r\n", 1)[0])
            while conn.recv(65536):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self._conns:
            c.close()


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], opened: asyncio.Event | None = None
                  ) -> dict[str, Any]:
    """One streaming completion: {ok, status, replica, t_start, t_end, error}."""
    out: dict[str, Any] = {"t_start": time.monotonic(), "ok": False, "status": 0, "replica": None, "error": None}
    try:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            out["status"] = resp.status
            out["replica"] = resp.headers.get("x-kvlab-routed-to")
            if opened is not None:
                opened.set()
            data = await resp.read()
            out["ok"] = resp.status == 200 and data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
            if not out["ok"]:
                out["error"] = data[-300:].decode(errors="replace")
            events = [json.loads(e[6:]) for e in data.decode(errors="replace").split("\n\n")
                      if e.startswith("data: {")]
            out["ids"] = len({e.get("id") for e in events if e.get("choices")})
            out["finishes"] = sum(1 for e in events for c in e.get("choices") or [] if c.get("finish_reason"))
            out["text"] = "".join(c.get("text") or "" for e in events for c in e.get("choices") or [])
    except (TimeoutError, aiohttp.ClientError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["t_end"] = time.monotonic()
    return out


def sigkill_under_load(run_dir: Path, streams: int = 16, max_tokens: int = 400) -> dict[str, Any]:
    """Two replicas (separate processes), `streams` long streams round-robin over them; one replica
    is SIGKILLed once every stream is open, while new short streams arrive every 50 ms for 3 s."""
    with sim(run_dir, "sim-a", "--time-scale", "1") as (_, ra), \
            sim(run_dir, "sim-b", "--time-scale", "1") as (b, rb), \
            gateway(run_dir, ra + rb, policy="round-robin") as (_, url):
        async def go() -> dict[str, Any]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                long = {"prompt": "a long story", "max_tokens": max_tokens, "ignore_eos": True}
                opened = [asyncio.Event() for _ in range(streams)]
                tasks = [asyncio.create_task(_stream(s, url, long, e)) for e in opened]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 30)
                await asyncio.sleep(0.5)
                eps = _get_json(url + "/debug/endpoints")["replicas"]
                on_b = next(r["load"]["inflight"] for r in eps if r["name"] == rb[0].name)
                os.kill(b.pid, signal.SIGKILL)
                t_kill = time.monotonic()
                late = []
                while time.monotonic() - t_kill < 3.0:
                    late.append(asyncio.create_task(_stream(s, url, {"prompt": "short", "max_tokens": 4})))
                    await asyncio.sleep(0.05)
                results = await asyncio.gather(*tasks, *late)
                metrics = await (await s.get(url + "/metrics")).text()
            after = [r for r in results if r["t_start"] >= t_kill + 1.0]
            failed = [r for r in results if not r["ok"]]
            resumed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                          if line.startswith(names.KVLAB_RESUMES + "_total{"))
            # the simulator's text depends only on its seed and the prompt: every long stream that ran
            # on one replica is the same text; a resumed one must start with a part of it and go on to
            # exactly max_tokens words, one id and one finish reason (no gap, no repeat)
            whole = Counter(r.get("text", "") for r in results[:streams] if r["replica"] != rb[0].name)
            reference = whole.most_common(1)[0][0].split() if whole else []
            continued = [r for r in results[:streams] if r["replica"] == rb[0].name and r["ok"]]
            def intact(r: dict[str, Any]) -> bool:
                words = r["text"].split()
                kept = next((i for i, (a, b) in enumerate(zip(words, reference, strict=False)) if a != b), len(words))
                return len(words) == max_tokens and 0 < kept < max_tokens and r["ids"] == 1 and r["finishes"] == 1
            return {"streams": streams, "inflight_on_killed": on_b, "failed": len(failed), "resumed": int(resumed),
                    "resumed_intact": sum(intact(r) for r in continued), "resumed_streams_ok": len(continued),
                    "failed_after_1s": sum(not r["ok"] for r in after), "ok_after_1s": sum(r["ok"] for r in after),
                    "requests_after_kill": len(late),
                    "last_failure_after_kill_s": round(max((r["t_end"] - t_kill for r in failed), default=0.0), 3)}
        return asyncio.run(go())


def hung_replica(run_dir: Path, requests: int = 8, first_byte_s: float = 1.0) -> dict[str, Any]:
    """A replica that accepts and never answers next to a healthy one (round-robin): every request
    still succeeds, retried after `first_byte_s` when it was sent to the hung one."""
    hole = BlackHole()
    try:
        with sim(run_dir, "sim-ok", "--time-scale", "0.01") as (_, ok):
            replicas = [Endpoint(name="hung", url=hole.url), *ok]
            config = {"timeouts": {"first_byte_s": first_byte_s, "scrape_s": 0.5},
                      "health": {"eject_after_failures": 1000}}   # keep sending it some: measure every retry
            with gateway(run_dir, replicas, config, policy="round-robin") as (_, url):
                lat, good = [], 0
                for i in range(requests):
                    t0 = time.monotonic()
                    req = urllib.request.Request(url + "/v1/completions", json.dumps(
                        {"prompt": f"hello {i}", "max_tokens": 4}).encode(), {"Content-Type": "application/json"})
                    try:
                        with urllib.request.urlopen(req, timeout=30) as r:
                            good += r.status == 200
                    except OSError:
                        pass
                    lat.append(time.monotonic() - t0)
        return {"requests": requests, "ok": good, "routed_to_hung": sum(r.startswith(b"POST") for r in hole.requests),
                "max_latency_s": round(max(lat), 3), "p50_latency_s": round(statistics.median(lat), 3),
                "first_byte_s": first_byte_s}
    finally:
        hole.close()


def _p50_ms(url: str, n: int) -> float:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        req = urllib.request.Request(url + "/v1/completions", json.dumps(
            {"prompt": f"trace me {i}", "max_tokens": 2}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1000


def trace_backend_black_hole(run_dir: Path, requests: int = 200) -> dict[str, Any]:
    """The same requests with traces off, to a backend that is down (refused), and to one that
    accepts and never answers: latency p50, errors, the gateway's memory."""
    hole = BlackHole()
    out: dict[str, Any] = {"requests": requests, "errors": 0}
    try:
        for label, env in (("no_traces", NO_TRACES),
                           ("down", {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{HOST}:{free_port()}"}),
                           ("black_hole", {"OTEL_EXPORTER_OTLP_ENDPOINT": hole.url})):
            env = {**env, "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}
            with sim(run_dir, f"sim-{label}", "--time-scale", "0.01", env=env) as (_, reps), \
                    gateway(run_dir, reps, env=env) as (g, url):
                try:
                    out[f"p50_ms_{label}"] = round(_p50_ms(url, requests), 2)
                except (OSError, RuntimeError):
                    out["errors"] += 1
                out[f"gateway_rss_mb_{label}"] = round(rss_mb(g.pid), 1)
        out["black_hole_connections"] = len(hole.requests)
        return out
    finally:
        hole.close()


def open_streams(run_dir: Path, streams: int = 1000, max_tokens: int = 32) -> dict[str, Any]:
    """`streams` streaming requests held open at once through one gateway (two replicas in one
    simulator process): errors, the peak the gateway counted in flight, its memory before/during."""
    with sim(run_dir, "sim-wide", "--replicas", "2", "--time-scale", "0.5", "--max-num-seqs", "1024",
             "--num-blocks", "20000") as (_, reps), gateway(run_dir, reps) as (g, url):
        rss0 = rss_mb(g.pid)

        async def go() -> dict[str, Any]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=600)) as s:
                opened = [asyncio.Event() for _ in range(streams)]
                t0 = time.monotonic()
                tasks = [asyncio.create_task(_stream(s, url, {"prompt": f"stream {i} of many", "max_tokens": max_tokens,
                                                              "ignore_eos": True}, opened[i])) for i in range(streams)]
                peak, rss_peak = 0, rss0
                while not all(t.done() for t in tasks):
                    eps = await asyncio.to_thread(_get_json, url + "/debug/endpoints")
                    peak = max(peak, sum(r["load"]["inflight"] for r in eps["replicas"]))
                    rss_peak = max(rss_peak, rss_mb(g.pid))
                    await asyncio.sleep(0.1)
                results = [t.result() for t in tasks]
                return {"streams": streams, "errors": sum(not r["ok"] for r in results), "peak_inflight": peak,
                        "gateway_rss_mb_idle": round(rss0, 1), "gateway_rss_mb_peak": round(rss_peak, 1),
                        "wall_s": round(time.monotonic() - t0, 1),
                        "sample_error": next((r["error"] for r in results if not r["ok"]), None)}
        return asyncio.run(go())


def scrape(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples at `url`/metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def drop_client(url: str, body: dict[str, Any], read_bytes: int, ready: Callable[[], None] | None = None) -> None:
    """Send a completion, read `read_bytes` of the answer, call `ready` (default: wait 0.5 s when
    nothing was read, so the engine is working on it), then reset the connection."""
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while len(got) < read_bytes:
        got += s.recv(4096)
    if ready is not None:
        ready()
    elif not read_bytes:
        time.sleep(0.5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


def disconnect_abort(run_dir: Path, trials: int = 5) -> dict[str, Any]:
    """Clients that drop a long generation through the gateway, mid-stream and before the first
    byte: the slowest time until the engine's `vllm:num_requests_running` and the gateway's
    in-flight count were both 0 again."""
    with sim(run_dir, "sim", "--time-scale", "1", "--max-model-len", "4096") as (_, reps), \
            gateway(run_dir, reps) as (_, url):
        out: dict[str, Any] = {"trials": trials}
        for mode, read_bytes in (("mid_stream", 600), ("before_first_byte", 0)):
            worst = 0.0
            for _ in range(trials):
                drop_client(url, {"prompt": "a long story", "max_tokens": 1500, "ignore_eos": True,
                                  "stream": bool(read_bytes)}, read_bytes)
                t0 = time.monotonic()
                while (scrape(reps[0].url, "vllm:num_requests_running") > 0
                       or any(r["load"]["inflight"] for r in _get_json(url + "/debug/endpoints")["replicas"])):
                    if time.monotonic() - t0 > 10:
                        break
                    time.sleep(0.01)
                worst = max(worst, time.monotonic() - t0)
            out[f"{mode}_abort_s_max"] = round(worst, 3)
        return out


def slowloris(run_dir: Path, connections: int = 200, idle_s: float = 2.0) -> dict[str, Any]:
    """`connections` clients that trickle header lines and never finish a request, with the gateway's
    client_idle_s at `idle_s`: when the last was cut off, and whether a normal request was served
    meanwhile."""
    with sim(run_dir, "sim", "--time-scale", "0.01") as (_, reps), \
            gateway(run_dir, reps, {"timeouts": {"client_idle_s": idle_s}}) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        socks = []
        t0 = time.monotonic()
        for _ in range(connections):
            s = socket.create_connection((HOST, port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            s.setblocking(False)
            socks.append(s)
        served = _p50_ms(url, 5)
        open_ = set(range(connections))
        while open_ and time.monotonic() - t0 < idle_s * 5:
            for i in list(open_):
                try:
                    socks[i].send(b"X-Slow: 1\r\n")
                    if socks[i].recv(1) == b"":
                        open_.discard(i)
                except BlockingIOError:
                    pass
                except OSError:
                    open_.discard(i)
            time.sleep(0.2)
        cut = time.monotonic() - t0
        for s in socks:
            s.close()
        return {"connections": connections, "client_idle_s": idle_s, "still_open": len(open_),
                "all_cut_after_s": round(cut, 2), "p50_ms_meanwhile": round(served, 2)}


def kv_event_gap(replay: bool, resync_s: float = 0.5, block_size: int = 16, lost: int = 4) -> dict[str, Any]:
    """A replica's KV-event stream drops and comes back, over real ZMQ sockets: the publisher
    unbinds, publishes `lost` batches nobody hears and binds again. With a replay endpoint (vLLM's
    protocol) the gateway's feed fetches the lost batches; without, it marks the replica stale
    until `resync_s` of gap-free events. Returns the feed's state and index after the gap."""
    from kvlab.contract import Endpoint
    from kvlab.gateway.endpoints import Backend
    from kvlab.gateway.kvevents import EventFeed
    from kvlab.kvcache.events import BlockStored
    from kvlab.kvcache.hashing import block_keys
    from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
    from kvlab.kvcache.transport import EventPublisher

    prompt = list(range(1000, 1000 + (2 * lost + 4) * block_size))
    keys = {block_size: block_keys(prompt, block_size)}

    def stored(b: int) -> BlockStored:
        return BlockStored(block_hashes=[10_000 + b], parent_block_hash=None if b == 0 else 10_000 + b - 1,
                           token_ids=prompt[b * block_size:(b + 1) * block_size], block_size=block_size)

    async def until(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(what)
            await asyncio.sleep(0.01)

    async def go() -> dict[str, Any]:
        endpoint = f"tcp://{HOST}:{free_port()}"
        pub = EventPublisher(endpoint, bind=True, replay=f"tcp://{HOST}:*" if replay else None)
        precise, approx = PreciseIndex(), ApproximateIndex()
        gap_seen: list[float] = []     # when the feed went stale: the resync clock starts there
        feed = EventFeed(precise, approx, resync_s=resync_s,
                         on_batch=lambda _r, rec: gap_seen.append(time.monotonic()) if rec.gap else None)
        r = Backend(Endpoint(name="a", url="http://x", kv_events=endpoint, kv_replay=pub.replay_endpoint))

        def known() -> int:
            return precise.match(keys, {"a": block_size})["a"] // block_size

        task = asyncio.create_task(feed.run(r))
        try:
            t0 = time.monotonic()
            while r.events_state != "live":      # a slow joiner: publish until the subscriber hears it
                pub.publish([stored(0)])
                await asyncio.sleep(0.05)
                if time.monotonic() - t0 > 5:
                    raise TimeoutError("the subscriber never connected")
            for b in range(1, lost):
                pub.publish([stored(b)])
            await until(lambda: known() == lost, "blocks before the gap")
            before, caught_up = known(), r.events_replayed   # the slow joiner's catch-up, not the gap's
            pub._sock.unbind(pub.endpoint)       # the stream drops
            await asyncio.sleep(0.2)
            for b in range(lost, 2 * lost):
                pub.publish([stored(b)])
            pub._sock.bind(pub.endpoint)
            b, t_back = 2 * lost, time.monotonic()
            while r.events_gaps + r.events_replayed == caught_up:    # until the subscriber has reconnected
                pub.publish([stored(2 * lost + b % 4)])      # blocks past the lost ones
                b += 1
                await asyncio.sleep(0.05)
                if time.monotonic() - t_back > 5:
                    raise TimeoutError("the subscriber never reconnected")
            out = {"replay": replay, "lost_batches": lost, "blocks_before": before, "state_after_gap": r.events_state,
                   "gaps": r.events_gaps, "replayed": r.events_replayed - caught_up, "blocks_after_gap": known()}
            t_stale = time.monotonic()
            while r.events_state != "live":      # gap-free (empty) batches until it is trusted again
                pub.publish([])
                await asyncio.sleep(0.05)
                if time.monotonic() - t_stale > 5 * resync_s + 2:
                    raise TimeoutError("the replica's events were never trusted again")
            stale = out["state_after_gap"] == "stale" and gap_seen
            out["stale_s"] = round(time.monotonic() - gap_seen[0], 2) if stale else 0.0
            return out
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()
    return asyncio.run(go())
