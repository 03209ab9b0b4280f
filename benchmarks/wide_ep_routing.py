"""DP-aware vs rank-blind routing on one wide-EP replica, replayed in virtual time (deterministic).

    .venv/bin/python benchmarks/wide_ep_routing.py [--seeds 1,2,3] [--requests 300] [--rate 25]

Prints, per policy, the delivered hit rate, the worst rank's peak and mean queue, mean TTFT and
the time spent waiting for the busiest DP rank / the slowest EP rank (docs/wide-ep.md).
"""

from __future__ import annotations

import argparse
import random

from kvlab.engine.sim.profile import get_profile
from kvlab.engine.sim.replay import replay, shared_prefix_workload
from kvlab.gateway.config import load_policy
from kvlab.gateway.scheduler import presets


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=25.0)
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=1024)
    a = p.parse_args()
    prof = get_profile("cpu-tiny-moe")
    print(f"{'seed':>4} {'policy':<11} {'hit':>6} {'peakQ':>6} {'meanQ':>6} {'TTFT ms':>8} {'DP wait s':>9} {'EP wait s':>9}")
    for seed in (int(s) for s in a.seeds.split(",")):
        wl = shared_prefix_workload(seed=seed, n=a.requests, groups=a.groups, rate_per_s=a.rate)
        for policy in ("rank-blind", "dp-aware"):
            r = replay(wl, presets.build(load_policy(policy), random.Random(seed)), prof,
                       data_parallel_size=a.ranks, max_num_seqs=16, num_blocks=a.num_blocks, seed=seed)
            print(f"{seed:>4} {policy:<11} {r.hit_rate:>6.3f} {r.worst_peak_waiting:>6} {r.worst_mean_waiting:>6.2f} "
                  f"{r.mean_ttft_ms:>8.0f} {r.dp_wait_ms / 1000:>9.1f} {r.moe_wait_ms / 1000:>9.1f}")


if __name__ == "__main__":
    main()
