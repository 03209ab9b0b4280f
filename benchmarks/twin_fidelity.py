"""The twin against a live stack, side by side: one `kvlab compare` run and the twin with the same
topology, routers, workload, seed, users and run time; per router the delivered hit rate and TTFT
p50/p95, live and twin, with the twin's ratio to live (docs/twin.md, "Validation").

    .venv/bin/python benchmarks/twin_fidelity.py --topology eviction --routers round-robin,kv-aware
    .venv/bin/python benchmarks/twin_fidelity.py --engine vllm --profile local --routers round-robin,kv-aware \\
        --duration 60          # real vLLM on CPU against the twin with `kvlab calibrate --name local`'s profile
    .venv/bin/python benchmarks/twin_fidelity.py --live runs/<id>/compare.json ...   # a live run made before

The hit rate compared is the twin's at the live run's request count (a loaded machine completes
fewer requests in the same time, and which prompts a replica has seen follows how many were sent);
TTFT is the twin's over the same run time. `--profile` runs the twin on a copy of the topology whose
`sim.profile` is that profile, keeping the topology's engine sizes (as the live engine has them).
A peer router that kvlab models runs as its model in the twin (`vllm-router:cache_aware` as the
`vllm-router-cache-aware` preset). A ✓ marks a row within the goals: hit rate ±0.03, TTFT within ±20 % (simulator) or p50 within
±30 % (vLLM).

`--measured-overhead` adds a twin run per router whose `request_overhead_ms` is the live run's own
time outside its engines, from the run's traces (kvlab/traces/overhead.py): per request, the
client's TTFT minus the engine's queue and prefill (the simulator's engine.queue span's start to its
engine.prefill span's end; vLLM's engine-core time_in_queue + time_in_model_prefill), the median over
the router's phase. `--overhead-from RUN_DIR` takes it from another live run instead: calibrated on
one run, checked on another. That is everything the twin does not model before a first
token (Locust, the gateway, the HTTP hops, the replica's request handling, the way back), measured
apart from the queueing and prefill the twin does model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import yaml

from kvlab.topology import builtin
from kvlab.traces.overhead import of_run
from kvlab.twin.runner import plans, run
from kvlab.twin.settings import Information, TwinSettings


def live_run(a: argparse.Namespace, run_dir: Path) -> dict[str, dict]:
    """`kvlab compare` on the live stack (or the one `--live` names); each router's row of its compare.json."""
    if a.live:
        doc = json.loads(Path(a.live).read_text())
        return {r["router"]: r for w in doc["workloads"].values() for r in w["routers"]}
    cmd = [sys.executable, "-m", "kvlab.cli", "compare", "--topology", a.topology, "--policies", a.routers,
           "--users", str(a.users), "--duration", str(a.duration), "--seed", str(a.seed), "--run-dir", str(run_dir)]
    if a.engine:
        cmd += ["--engine", a.engine]
    subprocess.run(cmd, check=True)
    doc = json.loads((run_dir / "compare.json").read_text())
    return {r["router"]: r for w in doc["workloads"].values() for r in w["routers"]}


def twin_topology(a: argparse.Namespace, out: Path) -> str:
    """The topology the twin runs: the live one, with `--profile` as its simulator profile."""
    if not a.profile:
        return a.topology
    path = Path(a.topology) if a.topology.endswith((".yaml", ".yml")) else builtin(a.topology)
    doc = yaml.safe_load(path.read_text())
    doc.setdefault("sim", {})["profile"] = a.profile
    copy = out / f"{doc['name']}-{a.profile}.yaml"
    copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(copy)


MODELS = {"vllm-router:cache_aware": "vllm-router-cache-aware"}   # peer router -> its model in the twin


def model(router: str) -> str:
    return MODELS.get(router, router)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--topology", help="default: quickstart, or vllm with --engine vllm")
    p.add_argument("--routers", default="round-robin,prefix,kv-aware")
    p.add_argument("--engine", choices=["sim", "vllm"])
    p.add_argument("--profile", help="the twin's latency profile (e.g. one `kvlab calibrate` wrote)")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--duration", type=float, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", help="where the live run goes (default: a temporary directory)")
    p.add_argument("--live", help="the compare.json of a live run made before with these settings: run no other")
    p.add_argument("--measured-overhead", action="store_true",
                   help="also run the twin with the live run's own time outside its engines (from its traces)")
    p.add_argument("--overhead-from", metavar="RUN_DIR",
                   help="as --measured-overhead, but measured in another live run (held out: that run calibrates the "
                        "overhead, this one checks it)")
    a = p.parse_args()
    a.topology = a.topology or ("vllm" if a.engine == "vllm" else "quickstart")
    vllm = a.engine == "vllm"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(a.live).parent if a.live else Path(a.run_dir or Path(tmp) / "live")
        live = live_run(a, run_dir)
        routers = a.routers.split(",")
        base = TwinSettings(topology=twin_topology(a, Path(tmp)), users=a.users, duration_s=a.duration,
                            requests=100_000, seed=a.seed)
        timed = {r: run(p, oracle=False).summary for r, p in zip(routers, plans(base, [model(r) for r in routers]))}
        counted = {}
        for r in routers:
            [plan] = plans(TwinSettings(topology=base.topology, users=a.users, requests=live[r]["requests"],
                                        seed=a.seed), [model(r)])
            counted[r] = run(plan, oracle=False).summary
        source = Path(a.overhead_from) if a.overhead_from else run_dir if a.measured_overhead else None
        overhead = of_run(source) if source is not None else {}
        measured = {}
        for r, ms in overhead.items():
            settings = msgspec.structs.replace(base, information=Information(request_overhead_ms=max(ms, 0.0)))
            [plan] = plans(settings, [model(r)])
            measured[r] = run(plan, oracle=False).summary
    print(f"\n{a.topology}, {a.engine or 'topology'} engine, {a.users} users, {a.duration:g} s, seed {a.seed}"
          f"{', twin profile ' + a.profile if a.profile else ''}")
    print(f"{'router':24} {'requests live/twin':>19} {'hit rate live/twin':>19} {'TTFT p50 live/twin ms':>26} "
          f"{'TTFT p95 live/twin ms':>26}")
    for r in routers:
        lv, tw = live[r], timed[r]
        hit = counted[r].hit_rate.delivered or 0.0
        p50, p95 = tw.ttft_ms.p50 / lv["ttft_p50_ms"], tw.ttft_ms.p95 / lv["ttft_p95_ms"]
        ok = abs(hit - lv["hit_rate"]) <= 0.03 and (abs(p50 - 1) <= 0.3 if vllm else
                                                    abs(p50 - 1) <= 0.2 and abs(p95 - 1) <= 0.2)
        print(f"{r:24} {lv['requests']:>9} / {tw.requests:<7} {lv['hit_rate']:>9.3f} / {hit:<7.3f} "
              f"{lv['ttft_p50_ms']:>9.0f} / {tw.ttft_ms.p50:<6.0f} ({p50:.2f}) "
              f"{lv['ttft_p95_ms']:>9.0f} / {tw.ttft_ms.p95:<6.0f} ({p95:.2f})  {'✓' if ok else '✗'}")
    if measured:
        whose = f"the time outside the engines of {a.overhead_from}" if a.overhead_from else \
            "the live run's time outside its engines"
        print(f"\nthe twin with {whose} as --request-overhead-ms")
        print(f"{'router':24} {'overhead ms':>12} {'TTFT p50 live/twin ms':>26} {'TTFT p95 live/twin ms':>26}")
        for r in (r for r in routers if r in measured):
            lv, tw = live[r], measured[r]
            p50, p95 = tw.ttft_ms.p50 / lv["ttft_p50_ms"], tw.ttft_ms.p95 / lv["ttft_p95_ms"]
            ok = abs(p50 - 1) <= 0.3 if vllm else abs(p50 - 1) <= 0.2 and abs(p95 - 1) <= 0.2
            print(f"{r:24} {overhead[r]:>12.1f} {lv['ttft_p50_ms']:>9.0f} / {tw.ttft_ms.p50:<6.0f} ({p50:.2f}) "
                  f"{lv['ttft_p95_ms']:>9.0f} / {tw.ttft_ms.p95:<6.0f} ({p95:.2f})  {'✓' if ok else '✗'}")


if __name__ == "__main__":
    main()
