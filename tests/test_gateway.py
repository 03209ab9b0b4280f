"""Gateway proxy behaviour against in-process fake replicas (fast, deterministic failure modes).

The fakes speak the replica contract (OpenAI API, /metrics, x-kvlab-replica, usage with
cached_tokens from a real prefix cache) and can be told to break a stream mid-way or to be down.
Integration with the real simulator is in test_gateway_sim.py.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest
from aiohttp import web

from conftest import free_port
from kvlab.contract import Endpoint
from kvlab.gateway.config import load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
from kvlab.gateway.server import Gateway
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.kvcache.hashing import block_keys
from kvlab.telemetry import names

_TOK = PromptTokenizer()


class FakeReplica:
    """A minimal vLLM-like replica with a real prefix cache (block size 16)."""

    def __init__(self, name: str, block_size: int = 16) -> None:
        self.name = name
        self.block_size = block_size
        self.cache: set[int] = set()
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.waiting = 0
        self.break_after: int | None = None   # stream chunks before the connection is cut
        self.chunks = 4
        self.delay = 0.02                     # seconds of "prefill" per request
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: web.AppRunner | None = None

    def _usage(self, payload: dict) -> dict:
        if "messages" in payload:
            ids, _ = _TOK.encode_chat(payload["messages"])
        else:
            ids, _ = _TOK.encode_text(payload["prompt"])
        keys = block_keys(ids, self.block_size)
        hit = 0
        for k in keys[:(len(ids) - 1) // self.block_size]:   # like vLLM: the last token is always computed
            if k not in self.cache:
                break
            hit += 1
        self.cache.update(keys)
        return {"prompt_tokens": len(ids), "completion_tokens": self.chunks, "total_tokens": len(ids) + self.chunks,
                "prompt_tokens_details": {"cached_tokens": hit * self.block_size}}

    async def complete(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.requests.append(payload)
        self.headers.append(dict(request.headers))
        usage = self._usage(payload)
        await asyncio.sleep(self.delay)
        hdr = {names.HEADER_REPLICA: self.name}
        if not payload.get("stream"):
            return web.json_response({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}],
                                      "usage": usage}, headers=hdr)
        resp = web.StreamResponse(headers={**hdr, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            if self.break_after is not None and i == self.break_after:
                request.transport.close()   # the replica dies mid-stream
                return resp
            await resp.write(b"data: " + json.dumps({"id": "x", "choices": [{"index": 0, "text": f"t{i}"}],
                                                     "usage": None}).encode() + b"\n\n")
            await asyncio.sleep(0.005)
        if (payload.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=(
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} 0.1\n'
            f'vllm:cache_config_info{{block_size="{self.block_size}",num_gpu_blocks="1000"}} 1.0\n'))

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "kvlab-tiny"}]}))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class Harness:
    def __init__(self, policy: str, n: int = 3, **cfg_over) -> None:
        self.replicas = [FakeReplica(f"fake-{i}") for i in range(n)]
        self.policy = policy
        self.cfg_over = cfg_over
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Harness:
        for r in self.replicas:
            await r.start()
        cfg = load_policy(self.policy)
        if self.cfg_over:
            cfg = msgspec.structs.replace(cfg, **self.cfg_over)
        eps = [Endpoint(name=r.name, url=r.url) for r in self.replicas]
        self.gw = Gateway(cfg, StaticDiscovery(eps), _TOK, scrape_interval_ms=50)
        self.runner = web.AppRunner(self.gw.app(), access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        await asyncio.wait_for(self.gw.ready.wait(), 5)
        self.client = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.runner.cleanup()
        for r in self.replicas:
            await r.stop()

    async def post(self, path: str, payload: dict | bytes) -> tuple[int, dict, bytes]:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        async with self.client.post(self.url + path, data=data,
                                    headers={"Content-Type": "application/json"}) as resp:
            return resp.status, dict(resp.headers), await resp.read()


def _doc(group: int) -> str:
    return " ".join(f"group{group} shared context line {i} about topic {group * 7 + i}." for i in range(40))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_round_robin_spreads_and_sets_headers_with_shadow_prefix():
    async def go():
        async with Harness("round-robin") as h:
            seen = []
            for i in range(6):
                st, hdr, body = await h.post("/v1/completions", {"model": "m", "prompt": _doc(0) + f" q{i}",
                                                                 "max_tokens": 4})
                assert st == 200, body
                seen.append(hdr[names.HEADER_ROUTED_TO])
                assert hdr[names.HEADER_POLICY] == "round-robin"
                assert int(hdr[names.HEADER_PROMPT_TOKENS]) > 100
                assert hdr[names.HEADER_REPLICA] == hdr[names.HEADER_ROUTED_TO]
                avail, pred = int(hdr[names.HEADER_PREFIX_AVAILABLE]), int(hdr[names.HEADER_PREFIX_PREDICTED])
                if i >= 1:   # the shared document was sent somewhere before: shadow scoring sees it
                    assert avail > 100
                if i >= 3:   # every replica has served it once
                    assert pred == avail
                delivered = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert int(hdr[names.HEADER_PREFIX_DELIVERED]) == delivered
            assert sorted(seen[:3]) == ["fake-0", "fake-1", "fake-2"]
            assert seen[:3] == seen[3:]
    run(go())


def test_prefix_policy_keeps_a_group_on_one_replica_and_delivers_prediction():
    def chat(g: int, i: int) -> dict:
        return {"model": "m", "messages": [{"role": "system", "content": _doc(g)},
                                           {"role": "user", "content": f"question {i}"}]}

    async def go():
        async with Harness("prefix") as h:
            where: dict[int, set[str]] = {}
            # the first request of each group arrives together: in-flight load spreads them
            first = await asyncio.gather(*(h.post("/v1/chat/completions", chat(g, g)) for g in range(3)))
            for g, (st, hdr, body) in enumerate(first):
                assert st == 200, body
                where[g] = {hdr[names.HEADER_ROUTED_TO]}
            assert len(set().union(*where.values())) == 3
            for i in range(3, 15):
                g = i % 3
                st, hdr, body = await h.post("/v1/chat/completions", chat(g, i))
                assert st == 200, body
                where[g].add(hdr[names.HEADER_ROUTED_TO])
                pred = int(hdr[names.HEADER_PREFIX_PREDICTED])
                delivered = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert pred > 0 and delivered >= 0.9 * pred
            assert all(len(v) == 1 for v in where.values()), where
    run(go())


def test_block_aligned_exact_repeat_predicts_what_the_engine_reuses():
    # a prompt of exactly 4 blocks, sent twice: all 4 blocks are cached, but the engine recomputes
    # the last token, so it reuses 3 blocks, and the gateway must predict exactly that
    words = ["cache", "token", "model", "server", "request", "route", "replica", "prefix", "latency", "queue", "batch", "memory"]
    text = " ".join(words * 6)
    ids = _TOK.encode_text(text)[0]
    text = _TOK.tok.decode(ids[:64])
    assert len(_TOK.encode_text(text)[0]) == 64

    async def go():
        async with Harness("prefix", n=1) as h:
            await h.post("/v1/completions", {"prompt": text})
            st, hdr, body = await h.post("/v1/completions", {"prompt": text})
            assert st == 200, body
            delivered = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert delivered == 48 == int(hdr[names.HEADER_PREFIX_PREDICTED])
            assert int(hdr[names.HEADER_PREFIX_AVAILABLE]) == 48
    run(go())


def test_stream_usage_requested_upstream_and_stripped_for_client():
    async def go():
        async with Harness("least-load", n=1) as h:
            st, hdr, body = await h.post("/v1/completions", {"prompt": "hello there", "stream": True})
            assert st == 200
            events = [e for e in body.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert not any('"usage": {' in e for e in events)           # not asked: stripped
            sent = h.replicas[0].requests[-1]
            assert sent["stream_options"]["include_usage"] is True      # but asked upstream
            assert len(events) == 1 + h.replicas[0].chunks
            st, hdr, body = await h.post("/v1/completions", {"prompt": "hello there", "stream": True,
                                                             "stream_options": {"include_usage": True}})
            assert any('"usage": {' in e for e in body.decode().split("\n\n"))
            text = (await (await h.client.get(h.url + "/metrics")).read()).decode()
            assert f'{names.KVLAB_PREFIX_TOKENS}_total{{kind="delivered",policy="least-load"}}' in text
    run(go())


@pytest.mark.parametrize("body,fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"messages": "hi"}).encode(), "messages"),
    (json.dumps({"messages": [{"content": "x"}]}).encode(), "role"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), "stream"),
])
def test_malformed_requests_get_400_json(body, fragment):
    async def go():
        async with Harness("kv-aware", n=1) as h:
            st, _, out = await h.post("/v1/chat/completions", body)
            assert st == 400
            err = json.loads(out)["error"]
            assert fragment in err["message"] and err["code"] == 400
            assert not h.replicas[0].requests
    run(go())


def test_oversized_request_gets_413_json():
    async def go():
        async with Harness("kv-aware", n=1) as h:
            big = json.dumps({"prompt": "x" * 5000}).encode()
            h.gw.cfg = msgspec.structs.replace(h.gw.cfg, limits=msgspec.structs.replace(h.gw.cfg.limits,
                                                                                      max_body_bytes=1000))
            st, _, out = await h.post("/v1/completions", big)
            assert st == 413 and "exceeds" in json.loads(out)["error"]["message"]
            st, _, out = await h.post("/v1/completions", {"prompt": 42})
            assert st == 400 and json.loads(out)["error"]["param"] == "prompt"
    run(go())


def test_refused_connection_is_retried_then_ejected_and_readmitted():
    async def go():
        async with Harness("round-robin") as h:
            h.gw.registry.readmit_after_s = 0.3
            dead = h.replicas[1]
            await dead.stop()
            for i in range(9):
                st, hdr, body = await h.post("/v1/completions", {"prompt": f"p{i}"})
                assert st == 200, body
                assert hdr[names.HEADER_ROUTED_TO] != dead.name
            await asyncio.sleep(0.3)
            assert not h.gw.registry.replicas[dead.name].healthy
            text = (await (await h.client.get(h.url + "/metrics")).read()).decode()
            assert f'{names.KVLAB_EJECTIONS}_total{{replica="{dead.name}"}} 1.0' in text
            assert f'{names.KVLAB_RETRIES}_total{{replica=' in text
            await dead.start()
            for _ in range(50):
                await asyncio.sleep(0.1)
                if h.gw.registry.replicas[dead.name].healthy:
                    break
            assert h.gw.registry.replicas[dead.name].healthy
            seen = {(await h.post("/v1/completions", {"prompt": f"again {i}"}))[1][names.HEADER_ROUTED_TO]
                    for i in range(3)}
            assert dead.name in seen
    run(go())


def test_broken_stream_ends_with_error_event_and_gateway_keeps_serving():
    async def go():
        async with Harness("least-load", n=1) as h:
            h.replicas[0].break_after = 2
            st, _, body = await h.post("/v1/completions", {"prompt": "hello", "stream": True})
            assert st == 200
            events = [e for e in body.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][len("data: "):])["error"]
            assert "broke the stream" in err["message"] and "fake-0" in err["message"]
            assert sum(1 for e in events if '"text"' in e) == 2
            h.replicas[0].break_after = None
            st, _, body = await h.post("/v1/completions", {"prompt": "hello", "stream": True})
            assert st == 200 and b"error" not in body
    run(go())


def test_debug_endpoints_health_and_models():
    async def go():
        async with Harness("kv-aware", n=2) as h:
            await asyncio.sleep(0.2)
            dbg = await (await h.client.get(h.url + "/debug/endpoints")).json()
            assert dbg["policy"] == "kv-aware"
            rep = {r["name"]: r for r in dbg["replicas"]}
            assert set(rep) == {"fake-0", "fake-1"}
            assert rep["fake-0"]["block_size"] == 16 and rep["fake-0"]["num_gpu_blocks"] == 1000
            assert rep["fake-0"]["events"]["state"] == "none"
            assert rep["fake-0"]["index"]["used"] == "approximate"
            assert (await h.client.get(h.url + "/health")).status == 200
            models = await (await h.client.get(h.url + "/v1/models")).json()
            assert models["data"][0]["id"] == "kvlab-tiny"
            for r in h.replicas:
                await r.stop()
            await asyncio.sleep(0.5)
            assert (await h.client.get(h.url + "/health")).status == 503
            st, _, body = await h.post("/v1/completions", {"prompt": "x"})
            assert st == 503 and "no healthy replica" in json.loads(body)["error"]["message"]
    run(go())


def test_cli_endpoint_flags(tmp_path):
    from kvlab.errors import ConfigError
    from kvlab.gateway import cli

    ready = tmp_path / "ready.json"
    ready.write_text(json.dumps({"replicas": [{"name": "sim-0", "url": "http://127.0.0.1:1", "kv_events":
                                               "tcp://127.0.0.1:2", "role": "both", "dp_rank": None,
                                               "replica": None}]}))
    args = cli.parser().parse_args(["--port", "1", "--policy", "kv-aware", "--endpoints-file", str(ready),
                                    "--endpoints", "a=http://127.0.0.1:5/,http://127.0.0.1:6",
                                    "--kv-events", "a=tcp://127.0.0.1:7,http://127.0.0.1:6=tcp://127.0.0.1:8"])
    eps = {e.name: e for e in cli.static_endpoints(args, load_policy("kv-aware"))}
    assert eps["sim-0"].kv_events == "tcp://127.0.0.1:2"
    assert eps["a"].url == "http://127.0.0.1:5" and eps["a"].kv_events == "tcp://127.0.0.1:7"
    assert eps["127.0.0.1:6"].kv_events == "tcp://127.0.0.1:8"
    bad = cli.parser().parse_args(["--port", "1", "--endpoints", "x=http://h:1", "--kv-events", "y=tcp://h:2"])
    with pytest.raises(ConfigError, match="names no endpoint"):
        cli.static_endpoints(bad, load_policy("kv-aware"))
    assert cli.main(["--port", str(free_port()), "--policy", "kv-aware"]) == 2   # no endpoints: clear error
