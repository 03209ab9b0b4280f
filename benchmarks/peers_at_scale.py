"""The field's routers at scale: one Mooncake trace at 16 and 64 replicas through round-robin, kvlab's
prefix and kv-aware, the vllm-router cache_aware model and llm-d's two shipped EndpointPickerConfig
files (kvlab/assets/epp/) in the twin, and Dynamo's round-robin and KV router in Dynamo's own replay
(twin/dynamo.py) with matched engines.

    KVLAB_TRACES_DIR=/path/to/traces .venv/bin/python benchmarks/peers_at_scale.py \\
        [--replicas 16,64] [--requests 10000] [--profile h100-llama3-8b] [--block-size 64] \\
        [--num-blocks 16384] [--slo-ttft-ms 2000] [--matched-prefill]

Prints one markdown row per run as it finishes: which simulator made it, the hit rate and its share
of the trace's oracle (Belady on the pooled KV of all replicas, from the trace's hash ids), TTFT
p50/p90/p99 and the share of requests within the SLO (TTFT and TPOT from the send).
`--matched-prefill` runs Dynamo's mocker at the profile's prefill speed (`prefill_matched_speedup`,
docs/twin.md) instead of its own default timing.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvlab.load.measure import Record
from kvlab.load.summary import Slo, summarize
from kvlab.twin import dynamo
from kvlab.twin.runner import plans, run_all
from kvlab.twin.settings import TwinSettings, resolve
from kvlab.twin.workers import default_jobs

TWIN = "round-robin,prefix,kv-aware,vllm-router-cache-aware,llm-d-approximate,llm-d-precise"
PEERS = "dynamo-round-robin,dynamo-kv-router"


def row(simulator: str, policy: str, replicas: int, records: list[Record], oracle: float, slo: Slo) -> str:
    s = summarize(records, slo)
    ttft = np.array([r.ttft_ms for r in records if not r.error and r.ttft_ms is not None])
    p50, p90, p99 = (float(np.percentile(ttft, q)) for q in (50, 90, 99))
    hit = s.hit_rate.delivered or 0.0
    good = s.goodput.share if s.goodput and s.goodput.share is not None else 0.0
    return (f"| {replicas} | {policy} | {simulator} | {hit:.3f} ({hit / oracle:.0%}) | {p50:,.0f} / {p90:,.0f} / "
            f"{p99:,.0f} | {good:.1%} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", default="mooncake-conversation")
    p.add_argument("--replicas", default="16,64")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=16_384)
    p.add_argument("--policies", default=TWIN, help="twin policies")
    p.add_argument("--peers", default=PEERS, help="Dynamo replays (empty: none)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--matched-prefill", action="store_true", help="Dynamo's mocker at the profile's prefill speed")
    a = p.parse_args()
    slo = Slo(ttft_ms=a.slo_ttft_ms, tpot_ms=a.slo_tpot_ms)
    label = f"Dynamo {dynamo.version()} replay"
    print(f"{a.trace}, first {a.requests:,} requests; {a.profile}, blocks of {a.block_size} tokens, "
          f"{a.num_blocks:,} per replica; SLO TTFT {a.slo_ttft_ms:.0f} ms, TPOT {a.slo_tpot_ms:.0f} ms\n")
    print("| replicas | policy | simulator | hit rate (of oracle) | TTFT p50 / p90 / p99 (ms) | within SLO |")
    print("|---|---|---|---|---|---|", flush=True)
    for replicas in (int(n) for n in a.replicas.split(",")):
        base = TwinSettings(trace=a.trace, profile=a.profile, replicas=replicas, requests=a.requests,
                            block_size=a.block_size, num_blocks=a.num_blocks)
        plan = resolve(base)
        oracle = dynamo.oracle(plan, dynamo.rows_of(plan)).hit_rate
        # kvlab's policies side by side, one process each (twin/workers.py), as `kvlab twin` runs them
        ran = run_all(plans(base, [n for n in a.policies.split(",") if n]), False, lambda plan: lambda n, v: None,
                      default_jobs())
        if ran.why is not None:
            raise SystemExit(f"peers_at_scale: {ran.why}")
        for r in ran.results:
            print(row("kvlab twin", r.plan.policy.name, replicas, r.records, oracle, slo), flush=True)
        speed = dynamo.prefill_matched_speedup(plan) if a.matched_prefill else 1.0
        for name in (n for n in a.peers.split(",") if n):
            d = dynamo.run(plan, name, speedup_ratio=speed)
            which = f", speedup_ratio {speed:.3f}" if a.matched_prefill else ""
            print(row(label + which, name, replicas, d.records, oracle, slo), flush=True)
    print(f"\noracle hit rate: Belady on the pooled KV, from the trace's hash ids ({a.trace})")


if __name__ == "__main__":
    main()
