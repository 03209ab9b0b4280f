"""The endpoint-discovery interface the gateway consumes."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable

import msgspec


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One routable replica (or one data-parallel rank of a replica)."""

    name: str                      # stable, human-readable: "sim-0", a pod name, "vllm-1-dp2"
    url: str                       # base URL of its OpenAI API, e.g. http://127.0.0.1:8001
    kv_events: str | None = None   # ZMQ endpoint of its KV events, e.g. tcp://127.0.0.1:5557
    kv_replay: str | None = None   # ZMQ endpoint that replays lost KV-event batches (vLLM's replay_endpoint)
    role: str = "both"             # both | prefill | decode
    dp_rank: int | None = None     # data-parallel rank when the replica runs several
    replica: str | None = None     # the replica this rank belongs to (None: the endpoint is the replica)


OnChange = Callable[[list[Endpoint]], Awaitable[None]]


class Discovery(abc.ABC):
    """Calls `on_change` with the complete current endpoint set whenever it changes."""

    @abc.abstractmethod
    async def run(self, on_change: OnChange) -> None:
        """Run until cancelled; the first call to `on_change` happens as soon as endpoints are known."""


class StaticDiscovery(Discovery):
    """A fixed list (from flags or the config file)."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = list(endpoints)

    async def run(self, on_change: OnChange) -> None:
        await on_change(list(self.endpoints))
