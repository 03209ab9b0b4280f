"""One bookkeeping for every upstream call (gateway/upstream.py): the proxied request, the P/D
prefill call and chunked decoding each hold a Lease on their replica while it works — in flight,
in-flight prefill tokens, pending prefill work — and give it back when the call ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from aiohttp import web

from conftest import free_port
from kvlab.contract import Endpoint
from kvlab.gateway.config import load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
from kvlab.gateway.server import Gateway
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names

PROMPT = list(range(10, 310))          # 300 uncached tokens: over the P/D threshold below


async def _replicas(seen: dict[str, dict[str, int]], gw_ref: list[Gateway]) -> tuple[list[web.AppRunner], list[Endpoint]]:
    """A prefill and a decode replica that record the gateway's books of themselves mid-call."""
    def book(name: str) -> dict[str, int]:
        r = gw_ref[0].registry.replicas[name]
        return {"inflight": r.inflight, "inflight_tokens": r.inflight_tokens, "pending": r.pending_prefill_tokens}

    async def prefill(request: web.Request) -> web.Response:
        seen["prefill"] = book("prefill")
        return web.json_response({"choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 300, "completion_tokens": 1},
                                  "kv_transfer_params": {"remote_block_ids": [1, 2], "do_remote_prefill": True}})

    async def decode(request: web.Request) -> web.Response:
        body = await request.json()
        seen["decode"] = {**book("decode"), "kv": int("kv_transfer_params" in body)}
        return web.json_response({"choices": [{"text": "ok", "index": 0, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 300, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 288}}})

    runners, eps = [], []
    for name, handler in (("prefill", prefill), ("decode", decode)):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        eps.append(Endpoint(name=name, url=f"http://127.0.0.1:{port}", role=name))
    return runners, eps


def test_the_prefill_call_and_the_decode_call_each_lease_their_replica(tmp_path: Path) -> None:
    async def main() -> tuple[dict[str, dict[str, int]], dict[str, str], dict[str, dict[str, int]]]:
        seen: dict[str, dict[str, int]] = {}
        gw_ref: list[Gateway] = []
        runners, eps = await _replicas(seen, gw_ref)
        cfg = tmp_path / "pd.yaml"
        cfg.write_text("pd: {threshold_tokens: 128}\nhealth: {scrape_interval_ms: 60000}\n")
        gw = Gateway(load_policy("kv-aware", cfg), StaticDiscovery(eps), PromptTokenizer())
        gw_ref.append(gw)
        runner = web.AppRunner(gw.app(), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await gw.ready.wait()
        try:
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "m", "prompt": PROMPT, "max_tokens": 2}) as resp:
                assert resp.status == 200, await resp.text()
                headers = dict(resp.headers)
            after = {n: {"inflight": r.inflight, "inflight_tokens": r.inflight_tokens,
                         "pending": r.pending_prefill_tokens, "routed": r.routed}
                     for n, r in gw.registry.replicas.items()}
            return seen, headers, after
        finally:
            await runner.cleanup()
            for r in runners:
                await r.cleanup()

    seen, headers, after = asyncio.run(main())
    assert headers[names.HEADER_PD_DECISION] == "split" and headers[names.HEADER_PREFILLED_BY] == "prefill"
    # during its call the prefill replica carried the whole uncached prompt (it used to count none)
    assert seen["prefill"] == {"inflight": 1, "inflight_tokens": 300, "pending": 300}
    assert seen["decode"]["inflight"] == 1 and seen["decode"]["kv"] == 1
    assert headers[names.HEADER_PREFIX_DELIVERED] == "288" and headers[names.HEADER_PROMPT_TOKENS] == "300"
    # and both gave everything back
    for name in ("prefill", "decode"):
        assert after[name] == {"inflight": 0, "inflight_tokens": 0, "pending": 0, "routed": 1}, (name, after)
