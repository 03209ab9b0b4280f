"""How fast the cluster twin runs: replicas x requests of a Mooncake trace, one policy.

    KVLAB_TRACES_DIR=/path/to/traces .venv/bin/python benchmarks/twin_speed.py \\
        [--cases 16x10000,32x10000,64x10000,128x10000] [--policy kv-aware] [--profile h100-llama3-8b] \\
        [--trace mooncake-conversation] [--time-scale 1.0] [--oracle] [--where] \\
        [--before /path/to/older/checkout/instrumentation]

Each case runs in a fresh process, so its peak RSS is its own. Prints, per case, the wall and CPU time of
the run (settings parsed and the trace read before the clock starts; with `--oracle`, the oracle's
ceiling after the run counted too, as `kvlab twin` computes it), requests simulated per second,
the virtual time simulated and the speed-up over real time, the engine steps, the time spent in
the cyclic garbage collector (part of the CPU time) and the peak RSS.
With `--before`, every case runs first on that checkout's `instrumentation` directory, then on
this one, interleaved, so a loaded machine's noise falls on both alike. With `--where`, a sampling
profile of each run (its CPU time, a sample a millisecond) says which part of kvlab the time is spent
in: a sample counts for the innermost kvlab function on the stack, and that function's module names
the part (`PARTS`); unlike cProfile it adds no cost per call, so a part made of many small calls is
not overstated. Goal (docs/benchmarks.md):
16 x 10,000 conversation requests at 200x real time or more, under 1 GB.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from types import FrameType
from typing import Any

_HERE = Path(__file__).resolve()
# the parts of a twin run, by the modules (under instrumentation/kvlab/) their code is in; first match wins
PARTS = (("block pools", ("engine/sim/blockpool.py", "engine/sim/freequeue.py", "engine/sim/retention.py",
                          "engine/sim/tier.py", "engine/sim/transfer.py", "engine/sim/runpool.py")),
         ("engine scheduler", ("engine/sim/",)),
         ("precise index", ("kvcache/",)),
         ("router", ("gateway/",)),
         ("trace prompts", ("twin/feed.py", "twin/keys.py", "twin/clients.py", "twin/arrivals.py", "traces/",
                            "tokenizer.py")),
         ("event loop", ("twin/",)))


class Where:
    """A sampling profile by part: every millisecond of CPU time, the part of the innermost kvlab
    function on the stack (`PARTS`; "other" outside them)."""

    def __init__(self) -> None:
        self.samples: Counter[str] = Counter()
        self._parts: dict[str, str] = {}   # code file -> its part, "" outside kvlab

    def _part(self, filename: str) -> str:
        part = self._parts.get(filename)
        if part is None:
            _, found, inside = filename.replace(os.sep, "/").rpartition("/kvlab/")
            part = "" if not found else next((name for name, mods in PARTS if inside.startswith(mods)), "other")
            self._parts[filename] = part
        return part

    def _sample(self, _signum: int, frame: FrameType | None) -> None:
        while frame is not None:
            part = self._part(frame.f_code.co_filename)
            if part:
                self.samples[part] += 1
                return
            frame = frame.f_back
        self.samples["other"] += 1

    def __enter__(self) -> Where:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
        return self

    def __exit__(self, *_: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)

    def shares(self) -> dict[str, float]:
        total = sum(self.samples.values()) or 1
        return {part: n / total for part, n in self.samples.most_common()}


class Collections:
    """Wall time spent in the cyclic garbage collector while entered (its callbacks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._callback)


def one(case: str, a: argparse.Namespace) -> dict[str, Any]:
    """Run one case in this process; its figures."""
    from kvlab.load.oracle import ceiling
    from kvlab.twin.cluster import Cluster
    from kvlab.twin.feed import Feed
    from kvlab.twin.settings import TwinSettings, resolve

    replicas, requests = (int(x) for x in case.lower().split("x"))
    plan = resolve(TwinSettings(trace=a.trace, profile=a.profile, policy=a.policy, replicas=replicas,
                                requests=requests, block_size=a.block_size, time_scale=a.time_scale))
    feed = Feed(plan.workload)
    where = Where()
    start, cpu = time.perf_counter(), time.process_time()
    with where if a.where else nullcontext(), Collections() as collections:
        cluster = Cluster(plan, feed, keep_keys=a.oracle)
        out = cluster.run()
        hit = None
        if cluster.sent is not None:
            hit = ceiling(cluster.sent, plan.sim.block_size, plan.replicas * plan.num_blocks).hit_rate
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    done = [r for r in out.records if r.ttft_ms is not None]
    return {"replicas": replicas, "requests": len(out.records), "wall_s": wall, "cpu_s": cpu, "virtual_s": out.virtual_s,
            "steps": out.steps, "gc_s": collections.seconds, "ttft_p50_ms": sorted(r.ttft_ms for r in done)[len(done) // 2] if done else 0.0,
            "oracle": hit if hit is not None else -1.0,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "where": where.shares()}


def spawn(case: str, argv: list[str], instrumentation: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if instrumentation:
        env["PYTHONPATH"] = instrumentation
    cmd = [sys.executable, str(_HERE), "--one", case, *argv]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"case {case} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def row(label: str, f: dict[str, Any]) -> str:
    where = "".join(f"\n{'':>7} {share:>5.0%} {part}" for part, share in f["where"].items())
    return (f"{label:>7} {f['replicas']:>8.0f} {f['requests']:>8.0f} {f['wall_s']:>8.1f} {f['cpu_s']:>7.1f} "
            f"{f['requests'] / f['wall_s']:>8.0f} {f['virtual_s']:>10.0f} {f['virtual_s'] / f['wall_s']:>8.0f}x "
            f"{f['steps']:>10.0f} {f['ttft_p50_ms']:>11.0f} {f['gc_s']:>5.2f} {f['rss_mib']:>12.0f}{where}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="16x10000,32x10000,64x10000,128x10000",
                   help="REPLICASxREQUESTS, comma-separated")
    p.add_argument("--policy", default="kv-aware")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the profile's)")
    p.add_argument("--trace", default="mooncake-conversation")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="the trace's gaps times this (0.125: 8x its rate, to load 8x the replicas)")
    p.add_argument("--oracle", action="store_true", help="also keep the keys and compute the oracle's ceiling")
    p.add_argument("--where", action="store_true", help="also say which part of the twin the time is spent in")
    p.add_argument("--before", help="an older checkout's instrumentation directory: each case runs there first")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a)))
        return
    argv = ["--policy", a.policy, "--profile", a.profile, "--trace", a.trace, "--time-scale", str(a.time_scale)]
    if a.block_size:
        argv += ["--block-size", str(a.block_size)]
    if a.oracle:
        argv.append("--oracle")
    if a.where:
        argv.append("--where")
    print(f"{'code':>7} {'replicas':>8} {'requests':>8} {'wall s':>8} {'CPU s':>7} {'req/s':>8} {'virtual s':>10} "
          f"{'× real':>9} {'steps':>10} {'TTFT p50 ms':>11} {'GC s':>5} {'peak RSS MiB':>12}", flush=True)
    for case in a.cases.split(","):
        before = spawn(case, argv, a.before) if a.before else None
        if before is not None:
            print(row("before", before), flush=True)
        after = spawn(case, argv, None)
        print(row("now", after), flush=True)
        if before is not None:
            same = all(before[k] == after[k] for k in ("requests", "virtual_s", "steps", "ttft_p50_ms", "oracle"))
            print(f"{'':>7} {before['wall_s'] / after['wall_s']:.1f}x faster ({before['cpu_s'] / after['cpu_s']:.1f}x "
                  "less CPU), "
                  f"{'the same figures' if same else 'FIGURES DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
