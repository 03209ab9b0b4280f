"""When an open-loop twin run sends: a trace's own timestamps, a stepped ramp's stages, or the
arrival process's gaps, as one stream of virtual send times (the cluster takes one at a time)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvlab.load.stages import send_times
from kvlab.twin.settings import Plan


def arrivals(plan: Plan) -> Iterator[float]:
    """Open-loop send times in seconds: the trace's own (times time_scale) or the arrival process's."""
    if plan.trace_timing:
        from kvlab.load.workloads.trace import Trace
        assert isinstance(plan.workload, Trace)
        # past its last row the trace starts again (as the workload's sessions do), one mean gap later
        offsets = list(plan.workload.offsets(plan.settings.time_scale))
        period = offsets[-1] + (offsets[-1] / max(len(offsets) - 1, 1) if len(offsets) > 1 else 1.0)
        for n in itertools.count():
            for t in offsets:
                yield n * period + t
    if plan.stages:
        yield from send_times(plan.stages, plan.settings.arrival, plan.settings.seed)
        return
    assert plan.arrival is not None
    t = 0.0
    for gap in plan.arrival.gaps(plan.settings.seed):
        yield t
        t += gap
