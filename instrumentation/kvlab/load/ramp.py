"""A ramping load: the number of Locust users as a piecewise-linear function of time.

Deterministic (users at second t depend on t only), so two runs of a scenario put the same load
on the stack at the same moments. `kvlab.load.ramp_shape` turns it into a Locust LoadTestShape;
`kvlab lab --topology autoscale` ramps up, holds, drops and idles so the autoscaler has something
to follow up and then down (docs/autoscaling.md).
"""

from __future__ import annotations

import json
import math

import msgspec

from kvlab.config import Strict, convert
from kvlab.errors import ConfigError


class Ramp(Strict, frozen=True):
    """`points`: [[seconds, users], ...], strictly increasing in time, starting at 0; the users
    between two points are interpolated linearly (rounded); the load ends at the last point."""

    points: list[tuple[float, int]]

    def __post_init__(self) -> None:
        times = [t for t, _ in self.points]
        if len(self.points) < 2 or times[0] != 0 or any(b <= a for a, b in zip(times, times[1:])):
            raise ConfigError("ramp: needs >= 2 points [seconds, users] with strictly increasing times from 0")
        if any(u < 0 for _, u in self.points):
            raise ConfigError("ramp: users must be >= 0")

    @property
    def duration_s(self) -> float:
        return self.points[-1][0]

    @property
    def peak(self) -> int:
        return max(u for _, u in self.points)

    def users_at(self, t: float) -> int | None:
        """Users at `t` seconds since the start; None once the ramp is over."""
        if t > self.duration_s:
            return None
        t = max(t, 0.0)
        for (t0, u0), (t1, u1) in zip(self.points, self.points[1:]):
            if t <= t1:
                return math.floor(u0 + (u1 - u0) * (t - t0) / (t1 - t0) + 0.5)
        return self.points[-1][1]

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> Ramp:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"ramp: not JSON: {exc}") from None
        return convert(data, cls, "ramp")


def up_hold_down(duration_s: float, peak: int, base: int = 1) -> Ramp:
    """The autoscaling scenario's ramp: `base` → `peak` over the first 35 % of the run, hold to
    55 %, back to `base` by 60 %, then idle at `base` so the scale-down window can pass."""
    d = duration_s
    return Ramp(points=[(0.0, base), (round(0.35 * d, 1), peak), (round(0.55 * d, 1), peak),
                        (round(0.6 * d, 1), base), (round(d, 1), base)])
