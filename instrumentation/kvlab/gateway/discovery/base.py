"""The endpoint-discovery interface the gateway consumes."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable

from kvlab.contract import Endpoint

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
