"""Endpoints from a file the local stack rewrites when it scales (the engines' ready JSON shape:
`{"replicas": [Endpoint, ...]}`). Polled by modification time and content, so an atomic rename
by the writer is picked up within one interval; a missing or half-written file keeps the last
good set (never an empty one by accident)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from kvlab.contract import Endpoint
from kvlab.gateway.discovery.base import Discovery, OnChange

log = logging.getLogger(__name__)


def read_endpoints(path: str | Path) -> list[Endpoint]:
    """The endpoints of a ready-JSON file; raises ValueError/OSError when it is not one."""
    data = json.loads(Path(path).read_text())
    try:
        return [Endpoint(**rep) for rep in data["replicas"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not an engines' ready JSON: {exc}") from None


def write_endpoints(path: str | Path, endpoints: list[Endpoint]) -> None:
    """Replace the file atomically (the gateway never reads half of it)."""
    import msgspec

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(msgspec.json.encode({"replicas": endpoints}) + b"\n")
    tmp.replace(target)


class FileDiscovery(Discovery):
    def __init__(self, path: str | Path, interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.interval_s = interval_s

    async def run(self, on_change: OnChange) -> None:
        last: list[Endpoint] | None = None
        stamp = None
        while True:
            try:
                st = self.path.stat()
                if (st.st_mtime_ns, st.st_size) != stamp:
                    eps = read_endpoints(self.path)
                    stamp = (st.st_mtime_ns, st.st_size)
                    if eps != last:
                        last = eps
                        await on_change(list(eps))
            except (OSError, ValueError) as exc:
                log.debug("endpoints file %s: %s", self.path, exc)
            await asyncio.sleep(self.interval_s)
