"""`kvlab epp`: the gateway's flags (--port is the gRPC port), its policy, discovery and tokenizer."""

from __future__ import annotations

import argparse
import asyncio
import os

from kvlab.gateway import cli as gateway_cli
from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.discovery.base import Discovery
from kvlab.gateway.enginetokens import EngineTokens
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.lifecycle import announce_ready, stop_requested


def parser() -> argparse.ArgumentParser:
    p = gateway_cli.parser()
    p.prog = "kvlab epp"
    p.description = ("kvlab's scheduler as a Gateway API Inference Extension endpoint picker: Envoy "
                     "ext_proc over gRPC on --port (docs/gateway-api.md)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="HTTP port of /metrics, /health and /debug/endpoints")
    return p


async def serve(args: argparse.Namespace, cfg: PolicyConfig, disc: Discovery,
                tok: PromptTokenizer | EngineTokens) -> None:
    from aiohttp import web
    from grpc_health.v1 import health

    from kvlab.epp.bridge import Bridge
    from kvlab.epp.server import server, set_health
    from kvlab.gateway.server import Gateway

    gw = Gateway(cfg, disc, tok, model=args.model, scrape_interval_ms=args.scrape_interval_ms)
    runner = gw.runner()
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.metrics_port)
    await site.start()
    h = health.aio.HealthServicer()
    await set_health(h, ready=False)
    srv = server(Bridge(gw), h, args.host, args.port)
    await srv.start()

    async def ready() -> None:
        await gw.ready.wait()
        await set_health(h, ready=True)

    waiter = asyncio.create_task(ready())
    announce_ready({"grpc": f"{args.host}:{args.port}", "url": f"http://{args.host}:{args.metrics_port}",
                    "policy": cfg.name, "pid": os.getpid()}, args.ready_file)
    await stop_requested()
    waiter.cancel()
    await srv.stop(grace=2.0)
    await runner.cleanup()


def main(argv: list[str]) -> int:
    return gateway_cli.run_server(parser().parse_args(argv), "kvlab epp", "kvlab-epp", serve)
