"""A thread that samples something every `interval_s` while a phase runs (the autoscale timeline,
an outage's watch): `start`/`stop` or a `with` block; subclasses say what one tick does."""

from __future__ import annotations

import threading
from typing import Any, Self


class Sampler:
    def __init__(self, interval_s: float, name: str) -> None:
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def tick(self) -> None:
        """One sample (append to `samples`); runs on the sampler's thread."""
        raise NotImplementedError

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()
