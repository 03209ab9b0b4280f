"""Fault figures for docs/reliability.md, measured in one run against real `kvlab engine sim` and
`kvlab gateway` processes (kvlab.scenarios.faults; tests/test_faults.py asserts the same properties).

    .venv/bin/python benchmarks/faults.py [--quick] [--only sigkill]

Prints, per scenario: client disconnects (time until the engine and the gateway dropped the work),
a replica SIGKILLed under streaming load, a hung replica, a trace backend down or black-holing,
1,000 concurrent streams through one gateway, and slowloris clients.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from rich.console import Console

from kvlab.scenarios import faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (CI-like)")
    p.add_argument("--only", metavar="WORD", help="run only the scenarios whose name contains WORD (e.g. SIGKILL)")
    a = p.parse_args()
    q = a.quick
    console = Console()
    console.print(f"machine: {platform.node()} {platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs")
    runs = [
        ("client disconnect", lambda d: faults.disconnect_abort(d, trials=3 if q else 10)),
        ("replica SIGKILL under streaming load", lambda d: faults.sigkill_under_load(d, streams=16 if q else 64)),
        ("hung replica", lambda d: faults.hung_replica(d, requests=8 if q else 20, first_byte_s=1.0)),
        ("trace backend down / black hole", lambda d: faults.trace_backend_black_hole(d, requests=100 if q else 500)),
        ("concurrent open streams", lambda d: faults.open_streams(d, streams=200 if q else 1000)),
        ("slowloris", lambda d: faults.slowloris(d, connections=50 if q else 500, idle_s=2.0)),
    ]
    for name, fn in runs:
        if a.only and a.only.lower() not in name.lower():
            continue
        with tempfile.TemporaryDirectory() as d, console.status(f"{name} ..."):
            t0 = time.monotonic()
            res = fn(Path(d))
        console.print(f"[bold]{name}[/] ({time.monotonic() - t0:.0f} s): {json.dumps(res)}")


if __name__ == "__main__":
    main()
