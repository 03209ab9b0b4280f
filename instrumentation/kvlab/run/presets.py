"""How long and how loud each run is by default: one table for the lab, its quick check, compare
and the autoscale and outage scenarios (the CLI flags override them)."""

from __future__ import annotations

import msgspec


class Preset(msgspec.Struct, frozen=True):
    duration_s: float    # seconds per phase (the autoscale scenario: the whole ramp)
    users: int           # concurrent Locust users (the autoscale scenario: at the peak)


# Users: 12 queue requests at the quickstart's two replicas, so routing decides the tail; the quick
# check and compare (one phase per router, five in a row) keep 8 to stay short; bench sends the lab's.
LAB = Preset(60.0, 12)
LAB_QUICK = Preset(25.0, 8)
COMPARE = Preset(30.0, 8)
AUTOSCALE = Preset(90.0, 16)
AUTOSCALE_QUICK = Preset(45.0, 12)
OUTAGE = Preset(20.0, 8)
OUTAGE_QUICK = Preset(10.0, 8)
