"""What one load test is: the bench spec every caller of the load generator fills once."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvlab.config import Strict
from kvlab.load.arrival import Arrival
from kvlab.load.ramp import Ramp
from kvlab.load.stages import Stage
from kvlab.load.summary import Slo


class BenchSpec(Strict, frozen=True):
    """One Locust run: which seeded workload, how many users for how long, against which model.

    With `ramp`, the ramp decides the users over time and the duration. With `min_requests`, a
    phase runs until `duration_s` has passed *and* that many requests completed, for at most
    `limit_s` (default 4 × `duration_s`).

    Open loop instead of users: `arrival` sends at that rate and process; the `trace` workload is
    replayed at its own timestamps times `time_scale`, or, with `arrival`, scaled to its rate.
    `slo` decides which requests count towards goodput."""

    workload: str = "shared-prefix"
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    users: int = 16
    spawn_rate: float | None = None     # users started per second (None: all at once)
    duration_s: float = 30.0
    seed: int = 0
    model: str = "kvlab-tiny"
    ramp: Ramp | None = None
    min_requests: int = 0
    limit_s: float | None = None
    arrival: Arrival | None = None
    stages: list[Stage] = msgspec.field(default_factory=list)   # a stepped open-loop ramp (load/stages.py)
    time_scale: Annotated[float, msgspec.Meta(gt=0)] | None = None
    slo: Slo = msgspec.field(default_factory=Slo)
    trace_sample_ratio: float = 1.0     # < 1: the client samples this share of traces (the topology's
                                        # observability.sample_ratio); else kvlab's default sampler

    @property
    def open_loop(self) -> bool:
        """Whether requests go at scheduled times (a rate, or a trace's timestamps)."""
        return self.arrival is not None or self.time_scale is not None or bool(self.stages)
