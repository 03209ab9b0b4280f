"""Cross-replica pull end to end (docs/tiered.md): the gateway passes over a busy holder of a long
prefix, sends the request elsewhere with `x-kvlab-kv-pull: HOLDER;TOKENS`, and the simulator on the
other side pulls those tokens' KV (priced as its P/D transfer) instead of recomputing them."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import free_port
from kvlab.engine.sim.cli import build_replicas, parser
from kvlab.gateway.config import load_policy
from kvlab.gateway.discovery.base import StaticDiscovery
from kvlab.gateway.server import Gateway
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.telemetry import names
from kvlab.telemetry.setup import configure_tracing


def test_a_busy_holder_is_passed_over_and_its_prefix_pulled(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    configure_tracing("kvlab-test", extra=SimpleSpanProcessor(exporter))
    rng = random.Random(7)
    prefix = [rng.randrange(10, 2000) for _ in range(1024)]

    async def main() -> tuple[dict[str, str], dict[str, str], str]:
        reps = []
        for name in ("sim-a", "sim-b"):
            args = parser().parse_args(["--time-scale", "0.05", "--no-kv-events", "--name", name])
            (r,), _ = build_replicas(args)
            await r.start("127.0.0.1", 0)
            reps.append(r)
        cfg = tmp_path / "pull.yaml"
        cfg.write_text("health: {scrape_interval_ms: 60000}\n")
        gw = Gateway(load_policy("kv-aware-pull", cfg), StaticDiscovery([r.endpoint() for r in reps]),
                     PromptTokenizer())
        runner = web.AppRunner(gw.app(), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await gw.ready.wait()

        async def complete(session: aiohttp.ClientSession, prompt: list[int]) -> dict[str, str]:
            body = {"model": "kvlab-tiny", "prompt": prompt, "max_tokens": 2}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return dict(resp.headers)

        try:
            async with aiohttp.ClientSession() as session:
                first = await complete(session, [*prefix, 5, 6, 7])
                holder = gw.registry.replicas[first[names.HEADER_ROUTED_TO]]
                holder.pending_prefill_tokens = 50_000      # the holder is swamped with prefill work
                holder.waiting = 40
                second = await complete(session, [*prefix, 8, 9, 10])
            return first, second, holder.name
        finally:
            await runner.cleanup()
            for r in reps:
                await r.stop()

    first, second, holder = asyncio.run(main())
    assert second[names.HEADER_ROUTED_TO] != holder
    # the other replica pulled the holder's prefix (whole blocks) instead of computing it
    assert int(second[names.HEADER_KV_TRANSFER_TOKENS]) == 1024
    assert int(second[names.HEADER_PREFIX_DELIVERED]) >= 1024
    decisions = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_PULL_DECISION]
    assert [(d.attributes[names.PULL_CHOICE], d.attributes[names.PULL_HOLDER]) for d in decisions] == [("pull", holder)]
