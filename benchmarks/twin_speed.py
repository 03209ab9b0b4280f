"""How fast the cluster twin runs: replicas x requests of a Mooncake trace, one policy.

    KVLAB_TRACES_DIR=/path/to/traces .venv/bin/python benchmarks/twin_speed.py \\
        [--cases 16x10000,32x10000,64x10000,128x10000] [--policy kv-aware] [--profile h100-llama3-8b] \\
        [--trace mooncake-conversation] [--time-scale 1.0] [--oracle] [--before /path/to/older/checkout/instrumentation]

Each case runs in a fresh process, so its peak RSS is its own. Prints, per case, the wall and CPU time of
the run (settings parsed and the trace read before the clock starts; with `--oracle`, the oracle's
ceiling after the run counted too, as `kvlab twin` computes it), requests simulated per second,
the virtual time simulated and the speed-up over real time, the engine steps and the peak RSS.
With `--before`, every case runs first on that checkout's `instrumentation` directory, then on
this one, interleaved, so a loaded machine's noise falls on both alike. Goal (docs/benchmarks.md):
16 x 10,000 conversation requests at 200x real time or more, under 1 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve()


def one(case: str, a: argparse.Namespace) -> dict[str, float]:
    """Run one case in this process; its figures."""
    from kvlab.load.oracle import ceiling
    from kvlab.twin.cluster import Cluster
    from kvlab.twin.feed import Feed
    from kvlab.twin.settings import TwinSettings, resolve

    replicas, requests = (int(x) for x in case.lower().split("x"))
    plan = resolve(TwinSettings(trace=a.trace, profile=a.profile, policy=a.policy, replicas=replicas,
                                requests=requests, block_size=a.block_size, time_scale=a.time_scale))
    feed = Feed(plan.workload)
    start, cpu = time.perf_counter(), time.process_time()
    cluster = Cluster(plan, feed, keep_keys=a.oracle)
    out = cluster.run()
    hit = None
    if cluster.sent is not None:
        hit = ceiling(cluster.sent, plan.sim.block_size, plan.replicas * plan.num_blocks).hit_rate
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    done = [r for r in out.records if r.ttft_ms is not None]
    return {"replicas": replicas, "requests": len(out.records), "wall_s": wall, "cpu_s": cpu, "virtual_s": out.virtual_s,
            "steps": out.steps, "ttft_p50_ms": sorted(r.ttft_ms for r in done)[len(done) // 2] if done else 0.0,
            "oracle": hit if hit is not None else -1.0,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def spawn(case: str, argv: list[str], instrumentation: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if instrumentation:
        env["PYTHONPATH"] = instrumentation
    cmd = [sys.executable, str(_HERE), "--one", case, *argv]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"case {case} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def row(label: str, f: dict[str, float]) -> str:
    return (f"{label:>7} {f['replicas']:>8.0f} {f['requests']:>8.0f} {f['wall_s']:>8.1f} {f['cpu_s']:>7.1f} "
            f"{f['requests'] / f['wall_s']:>8.0f} {f['virtual_s']:>10.0f} {f['virtual_s'] / f['wall_s']:>8.0f}x "
            f"{f['steps']:>10.0f} {f['ttft_p50_ms']:>11.0f} {f['rss_mib']:>12.0f}")


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
    print(f"{'code':>7} {'replicas':>8} {'requests':>8} {'wall s':>8} {'CPU s':>7} {'req/s':>8} {'virtual s':>10} "
          f"{'× real':>9} {'steps':>10} {'TTFT p50 ms':>11} {'peak RSS MiB':>12}", flush=True)
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
