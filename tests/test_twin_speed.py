"""benchmarks/twin_speed.py `--where`: a sample counts for the part of the innermost kvlab function
on the stack, so the figures in docs/benchmarks.md say where a twin run's time goes; its "GC s"
counts the collector's time in the run only."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from twin_speed import Collections, Where


def _frame_in(*files: str) -> FrameType:
    """A live frame whose stack holds functions from `files`, outermost first."""
    captured: list[FrameType] = []

    def call() -> None:   # the innermost function's frame is what a signal handler is given
        captured.append(sys._getframe(1))

    for name in reversed(files):   # each file's function calls the one from the file after it
        code = compile("def f():\n    inner()\n", name, "exec")
        scope: dict[str, object] = {"inner": call}
        exec(code, scope)
        call = scope["f"]  # type: ignore[assignment]
    call()
    return captured[0]


def test_a_sample_counts_for_the_innermost_kvlab_functions_part() -> None:
    where = Where()
    # the pool called by the engine's scheduler, calling the standard library: the pool's sample
    where._sample(0, _frame_in("/src/instrumentation/kvlab/engine/sim/scheduler.py",
                               "/src/instrumentation/kvlab/engine/sim/blockpool.py",
                               "/usr/lib/python3.11/heapq.py"))
    # the scheduler itself (engine/sim/ less the pool's modules), and kvlab outside every part
    where._sample(0, _frame_in("/src/instrumentation/kvlab/twin/cluster.py",
                               "/src/instrumentation/kvlab/engine/sim/scheduler.py"))
    where._sample(0, _frame_in("/src/instrumentation/kvlab/load/oracle.py"))
    where._sample(0, _frame_in("/usr/lib/python3.11/heapq.py"))   # no kvlab frame at all
    assert where.samples == {"block pools": 1, "engine scheduler": 1, "other": 2}
    assert where.shares() == {"other": 0.5, "block pools": 0.25, "engine scheduler": 0.25}


def test_the_collectors_time_counts_only_collections_while_entered() -> None:
    garbage = [[] for _ in range(200_000)]
    for x in garbage:
        x.append(x)   # cycles: only the collector frees them
    with Collections() as c:
        del garbage
        gc.collect()
    assert c.seconds > 0 and c._callback not in gc.callbacks
    took = c.seconds
    gc.collect()
    assert c.seconds == took
