"""Open-loop arrivals: when each request is sent, decided before the run and independent of replies.

A closed loop (N users, each sending when its last reply ended) slows its own arrivals down when
the stack slows down, so queues never build and the tail is understated (coordinated omission).
An arrival process instead fixes the send times: `poisson` (exponential gaps, CV 1, what
`vllm bench serve --request-rate` sends), `constant` (equal gaps, CV 0) and `gamma:CV` (gamma gaps
with that coefficient of variation: CV > 1 is burstier than Poisson, the shape of
`vllm bench serve --burstiness`, whose burstiness is 1/CV²). Every process is seeded.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Annotated, Literal

import msgspec

from kvlab.config import Strict
from kvlab.errors import ConfigError

PROCESSES = ("poisson", "constant", "gamma:CV")


class Arrival(Strict, frozen=True):
    """`rate` requests/s on average, gaps drawn by `process` (`cv` only for gamma)."""

    rate: Annotated[float, msgspec.Meta(gt=0)]
    process: Literal["poisson", "constant", "gamma"] = "poisson"
    cv: Annotated[float, msgspec.Meta(gt=0)] = 1.0

    @property
    def label(self) -> str:
        """How the command line spells the process: poisson, constant, gamma:2."""
        return f"gamma:{self.cv:g}" if self.process == "gamma" else self.process

    def gaps(self, seed: int) -> Iterator[float]:
        """The endless, seeded stream of gaps between sends, in seconds."""
        rng = random.Random(f"{seed}:arrival:{self.label}")
        mean = 1.0 / self.rate
        shape = 1.0 / (self.cv * self.cv)
        while True:
            if self.process == "constant":
                yield mean
            elif self.process == "poisson":
                yield rng.expovariate(self.rate)
            else:   # gamma with mean 1/rate and CV cv: shape k = 1/cv², scale = mean / k
                yield rng.gammavariate(shape, mean / shape)

    def times(self, seed: int, duration_s: float) -> list[float]:
        """Send times (seconds from the start) within `duration_s`; the first request at 0."""
        out: list[float] = []
        t = 0.0
        for gap in self.gaps(seed):
            if t >= duration_s:
                return out
            out.append(t)
            t += gap
        return out   # pragma: no cover (gaps() is endless)


def arrival(rate: float, process: str = "poisson") -> Arrival:
    """An `Arrival` from the command line's `--rate` and `--arrival poisson|constant|gamma:CV`."""
    if not rate > 0:
        raise ConfigError(f"--rate must be > 0 requests/s (got {rate:g})")
    name, _, cv = process.partition(":")
    if name == "gamma":
        try:
            value = float(cv)
        except ValueError:
            raise ConfigError(f"--arrival gamma needs a coefficient of variation, e.g. gamma:2 (got {process!r})") \
                from None
        if not value > 0:
            raise ConfigError(f"--arrival gamma:CV needs CV > 0 (got {process!r})")
        return Arrival(rate=rate, process="gamma", cv=value)
    if name in ("poisson", "constant") and not cv:
        return Arrival(rate=rate, process=name)  # type: ignore[arg-type]  # checked just above
    raise ConfigError(f"unknown --arrival {process!r}; choose one of: {', '.join(PROCESSES)}")


def rates(text: str) -> list[float]:
    """`--rates 1,2,4` as floats, each > 0 (a clear error otherwise)."""
    try:
        values = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rates takes comma-separated numbers of requests/s, e.g. 1,2,4 (got {text!r})") from None
    if not values:
        raise ConfigError("--rates names no rate")
    for r in values:
        if not r > 0:
            raise ConfigError(f"--rates: every rate must be > 0 requests/s (got {r:g})")
    return values
