"""How fast the cluster twin runs: replicas x requests of the Mooncake conversation trace, one policy.

    KVLAB_TRACES_DIR=/path/to/traces .venv/bin/python benchmarks/twin_speed.py \\
        [--cases 16x10000,64x50000] [--policy kv-aware] [--profile h100-qwen3-32b-tp2]

Prints, per case, the wall time of the run (settings parsed and the trace read before the clock
starts), requests simulated per second, the virtual time simulated and the speed-up over real
time, and the engine steps. Goal (docs/benchmarks.md): 16 x 10,000 under 60 s on 2 cores.
"""

from __future__ import annotations

import argparse
import resource

from kvlab.twin.feed import Feed
from kvlab.twin.runner import run
from kvlab.twin.settings import TwinSettings, resolve


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="16x10000,64x50000", help="REPLICASxREQUESTS, comma-separated")
    p.add_argument("--policy", default="kv-aware")
    p.add_argument("--profile", default="h100-qwen3-32b-tp2")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the profile's)")
    p.add_argument("--trace", default="mooncake-conversation")
    a = p.parse_args()
    print(f"{'replicas':>8} {'requests':>8} {'wall s':>8} {'req/s':>8} {'virtual s':>10} {'speed-up':>9} "
          f"{'steps':>10} {'hit rate':>8} {'TTFT p50 ms':>11} {'peak RSS MiB':>12}")
    for case in a.cases.split(","):
        replicas, requests = (int(x) for x in case.lower().split("x"))
        plan = resolve(TwinSettings(trace=a.trace, profile=a.profile, policy=a.policy, replicas=replicas,
                                    requests=requests, block_size=a.block_size))
        r = run(plan, oracle=False, feed=Feed(plan.workload))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{replicas:>8} {requests:>8} {r.wall_s:>8.1f} {len(r.records) / r.wall_s:>8.0f} "
              f"{r.outcome.virtual_s:>10.0f} {r.speedup:>8.0f}x {r.outcome.steps:>10} "
              f"{r.summary.hit_rate.delivered or 0:>8.3f} {r.summary.ttft_ms.p50 or 0:>11.0f} {rss:>12.0f}", flush=True)


if __name__ == "__main__":
    main()
