"""`kvlab gateway`: parse flags, load the policy, start discovery and serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.contract import Endpoint
from kvlab.errors import ConfigError, KvlabError
from kvlab.gateway.config import EPP_PRESETS, PRESETS, PolicyConfig
from kvlab.gateway.discovery.base import Discovery, StaticDiscovery
from kvlab.gateway.scheduler.epp import load, policy_of
from kvlab.lifecycle import announce_ready, run, stop_requested

if TYPE_CHECKING:
    from kvlab.gateway.enginetokens import EngineTokens
    from kvlab.gateway.tokens import PromptTokenizer

log = logging.getLogger("kvlab.gateway")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab gateway", description="The instrumented KV-aware gateway.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    p.add_argument("--endpoints", default="", help="[NAME=]URL[,...] of the replicas")
    p.add_argument("--kv-events", default="", help="NAME_OR_URL=tcp://HOST:PORT[,...]")
    p.add_argument("--endpoints-file", help="the engines' ready JSON ({'replicas': [Endpoint...]})")
    p.add_argument("--policy", choices=PRESETS + EPP_PRESETS,
                   help="policy preset (default: the config file's `preset`)")
    p.add_argument("--config", help="policy YAML merged over the preset (docs/gateway.md)")
    p.add_argument("--epp-config",
                   help="an llm-d/GIE EndpointPickerConfig YAML: its plug-ins schedule (docs/gateway.md)")
    p.add_argument("--model", help="served model name (informational; replicas validate it)")
    p.add_argument("--tokenizer", help="HF tokenizer directory (default: kvlab's own)")
    p.add_argument("--tokenize-via", choices=("local", "engine"), default="local",
                   help="engine: take prompt token ids from the replicas' render//tokenize endpoints "
                        "(tokens-in, tokens-out) instead of loading the tokenizer")
    p.add_argument("--scrape-interval-ms", type=int, help="load-view scrape interval (default 200)")
    p.add_argument("--ready-file", help="write {'url', 'policy', 'pid'} here once listening")
    p.add_argument("--discovery", choices=("static", "kubernetes", "file"), default="static",
                   help="file: watch --endpoints-file for changes (the local stack rewrites it when it scales)")
    p.add_argument("--namespace", default="default", help="--discovery kubernetes: the replicas' namespace")
    p.add_argument("--selector", default="app.kubernetes.io/component=replica",
                   help="--discovery kubernetes: the replica pods' label selector")
    p.add_argument("--replica-port", type=int, default=8000, help="--discovery kubernetes: the replicas' HTTP port")
    p.add_argument("--replica-kv-events-port", type=int, default=5557, help="0: replicas publish no events")
    p.add_argument("--log-level", default="INFO", help="Python logging level (default INFO)")
    return p


def _name_of(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def static_endpoints(args: argparse.Namespace, cfg: PolicyConfig) -> list[Endpoint]:
    """Endpoints from --endpoints-file, --endpoints and --kv-events (or the config file)."""
    eps: dict[str, Endpoint] = {}
    if args.endpoints_file:
        try:
            data = json.loads(Path(args.endpoints_file).read_text())
            for rep in data["replicas"]:
                e = Endpoint(**rep)
                eps[e.name] = e
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{args.endpoints_file}: not an engines' ready JSON: {exc}") from None
    for item in filter(None, (s.strip() for s in args.endpoints.split(","))):
        name, _, url = item.rpartition("=")
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--endpoints: {item!r} is not [NAME=]http://HOST:PORT")
        name = name or _name_of(url)
        eps[name] = Endpoint(name=name, url=url)
    if not eps:
        for s in cfg.endpoints:
            eps[s.name] = Endpoint(name=s.name, url=s.url.rstrip("/"), kv_events=s.kv_events, role=s.role)
    for item in filter(None, (s.strip() for s in args.kv_events.split(","))):
        key, sep, zmq_url = item.rpartition("=")
        if not sep or not zmq_url.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--kv-events: {item!r} is not NAME_OR_URL=tcp://HOST:PORT")
        key = key.rstrip("/")
        match = [n for n, e in eps.items() if key in (n, e.url)]
        if not match:
            raise ConfigError(f"--kv-events: {key!r} names no endpoint ({', '.join(eps)})")
        e = eps[match[0]]
        eps[e.name] = Endpoint(name=e.name, url=e.url, kv_events=zmq_url, role=e.role,
                               dp_rank=e.dp_rank, replica=e.replica)
    return list(eps.values())


def discovery(args: argparse.Namespace, cfg: PolicyConfig) -> Discovery:
    if args.discovery == "kubernetes":
        from kvlab.gateway.discovery.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery(args.namespace, args.selector, api_port=args.replica_port,
                                   kv_events_port=args.replica_kv_events_port or None)
    if args.discovery == "file":
        from kvlab.gateway.discovery.file import FileDiscovery

        if not args.endpoints_file:
            raise ConfigError("--discovery file needs --endpoints-file")
        return FileDiscovery(args.endpoints_file)
    eps = static_endpoints(args, cfg)
    if not eps:
        raise ConfigError("no endpoints: pass --endpoints, --endpoints-file or list them in --config")
    return StaticDiscovery(eps)


def token_source(args: argparse.Namespace, cfg: PolicyConfig) -> PromptTokenizer | EngineTokens:
    """Where prompt token ids come from; loading the tokenizer here makes a bad directory or
    template a start-up error that names the file."""
    if args.tokenize_via == "engine":
        from kvlab.gateway.enginetokens import EngineTokens

        return EngineTokens(args.model, cfg.tokenize_cache_entries)
    from kvlab.gateway.tokens import PromptTokenizer
    from kvlab.tokenizer import Tokenizer

    return PromptTokenizer(Tokenizer(args.tokenizer), cfg.tokenize_cache_entries)


async def serve(args: argparse.Namespace, cfg: PolicyConfig, disc: Discovery,
                tok: PromptTokenizer | EngineTokens) -> None:
    from aiohttp import web

    from kvlab.gateway.server import Gateway

    gw = Gateway(cfg, disc, tok, model=args.model, scrape_interval_ms=args.scrape_interval_ms)
    runner = gw.runner()
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024)
    await site.start()
    announce_ready({"url": f"http://{args.host}:{args.port}", "policy": cfg.name, "pid": os.getpid()},
                   args.ready_file)
    await stop_requested()
    await runner.cleanup()


Serve = Callable[[argparse.Namespace, PolicyConfig, Discovery, "PromptTokenizer | EngineTokens"],
                 Coroutine[Any, Any, None]]


def run_server(args: argparse.Namespace, prog: str, service: str, serve: Serve, export_process: bool = False) -> int:
    """Load the policy, discovery and tokenizer (a bad one is exit 2 with its reason), then serve
    until SIGTERM with tracing set up as `service`; `kvlab gateway` and `kvlab epp` both start so."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = policy_of(args.epp_config) if args.epp_config else load(args.policy, args.config)
        disc = discovery(args, cfg)
        tok = token_source(args, cfg)
    except KvlabError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    from kvlab.telemetry.setup import configure_tracing, shutdown_tracing

    configure_tracing(service, export_process=export_process)
    try:
        run(serve(args, cfg, disc, tok))
    except OSError as exc:
        print(f"{prog}: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    return 0


def main(argv: list[str]) -> int:
    return run_server(parser().parse_args(argv), "kvlab gateway", "kvlab-gateway", serve, export_process=True)
