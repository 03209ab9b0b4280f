"""The load view: each replica's /metrics, scraped on a short interval.

Reads only the few vLLM series the scheduler needs (waiting, running, KV usage,
`cache_config_info`'s block_size/num_gpu_blocks) with a line scan instead of a full
exposition parser: a scrape of a vLLM /metrics page is a few hundred lines every 200 ms per
replica. A failed scrape counts toward ejection (`endpoints.Registry`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from kvlab.gateway.endpoints import Backend, Registry
from kvlab.telemetry import names

log = logging.getLogger(__name__)

_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[str, float | dict[str, str]]:
    """{waiting, running, kv_usage: float, cache_config: {label: value}} from an exposition page.
    A replica with several engines (vLLM's `engine` label, one per data-parallel rank) reports a
    series per engine: queue and batch are summed, KV usage (a fraction of each engine's own
    cache) is averaged."""
    out: dict[str, float | dict[str, str]] = {}
    usage: list[float] = []
    wanted = {names.VLLM_NUM_REQUESTS_WAITING: "waiting", names.VLLM_NUM_REQUESTS_RUNNING: "running",
              names.VLLM_KV_CACHE_USAGE: "kv_usage"}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        labelled = "{" in line.split(" ", 1)[0]
        name, _, rest = line.partition("{" if labelled else " ")
        key = wanted.get(name)
        if key is not None:
            try:  # `name{labels} value [timestamp]` or `name value [timestamp]`
                value = float((rest.rsplit("}", 1)[1] if labelled else rest).split()[0])
            except (IndexError, ValueError):
                continue
            if key == "kv_usage":
                usage.append(value)
            else:
                out[key] = float(out.get(key, 0.0)) + value  # type: ignore[arg-type]
        elif name == names.VLLM_CACHE_CONFIG_INFO:
            out["cache_config"] = dict(_LABEL.findall(rest))
    if usage:
        out["kv_usage"] = sum(usage) / len(usage)
    return out


def apply_metrics(r: Backend, parsed: dict[str, Any]) -> None:
    r.waiting = float(parsed.get("waiting", 0.0))
    r.running = float(parsed.get("running", 0.0))
    r.kv_usage = float(parsed.get("kv_usage", 0.0))
    cc = parsed.get("cache_config") or {}
    try:
        if cc.get("block_size"):
            r.block_size = int(float(cc["block_size"]))
        if cc.get("num_gpu_blocks") not in (None, "", "None"):
            r.num_gpu_blocks = int(float(cc["num_gpu_blocks"]))
    except ValueError:
        pass


class LoadView:
    """Scrapes every replica due for it, concurrently, every `interval_s`."""

    def __init__(self, registry: Registry, session: aiohttp.ClientSession, interval_s: float = 0.2,
                 timeout_s: float = 1.0, on_update: Callable[[Backend], None] | None = None) -> None:
        self.registry = registry
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.on_update = on_update
        self.ejected_by_scrape = 0

    async def scrape(self, r: Backend) -> None:
        try:
            async with self.session.get(r.url + "/metrics", timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.registry.failure(r, f"scrape: {type(exc).__name__}: {exc}")
            return
        apply_metrics(r, parse_metrics(text))
        r.last_scrape = time.time()
        self.registry.success(r)
        if self.on_update is not None:
            self.on_update(r)

    async def run(self) -> None:
        while True:
            due = [r for r in list(self.registry.replicas.values()) if self.registry.due_for_probe(r)]
            if due:
                await asyncio.gather(*(self.scrape(r) for r in due), return_exceptions=True)
            await asyncio.sleep(self.interval_s)
