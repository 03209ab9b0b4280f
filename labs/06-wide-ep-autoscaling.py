# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 06 · Wide expert parallelism, data-parallel-aware routing, autoscaling
#
# **Objectives**
# 1. Serve a mixture-of-experts model as **2 replicas × 4 data-parallel ranks**: every rank has its
#    own KV cache, queue and KV-event stream, and the ranks of a replica step in lockstep.
# 2. Compare a **rank-blind** router (it picks the replica by cache, then any rank) with a
#    **DP-aware** one (it picks the rank): hit rate, TTFT, per-rank queues, and the time ranks idle
#    waiting for their busiest sibling (`kvlab.dp.wait_busiest_ms` on the MoE span).
# 3. Watch the gateway's **autoscaling recommendation** follow a load ramp, and the stack act on it.
#
# Reference: docs/wide-ep.md, docs/autoscaling.md.
#
# **Time:** about 90 s (two 12 s phases, then a 25 s ramp and its scale-down).
# **Stack:** starts `wide-ep` (2 replicas × 4 DP ranks), stopping lab 05's stack; stops it for
# section 3, whose `kvlab lab --topology autoscale` starts and stops its own stack.

# %% tags=["parameters"]
TARGET = "local"             # local only for now: the kind manifests render DP ranks, this lab is untested there
TOPOLOGY = "wide-ep"         # labs/topologies/wide-ep.yaml: 2 replicas x 4 DP ranks, profile cpu-tiny-moe
WORKLOAD = "shared-prefix"
USERS = 8
DURATION_S = 12.0            # per routing phase
RAMP_S = 25.0                # the autoscaling ramp: users 1 -> RAMP_USERS -> 1
RAMP_USERS = 10
SEED = 0

# %%
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from rich.console import Console

from kvlab import notebook as nb
from kvlab.load.measure import read_records
from kvlab.load.table import summary_table
from kvlab.report import figures
from kvlab.report.autoscale import figure as autoscale_figure
from kvlab.run.document import read_run
from kvlab.telemetry import names as n
from kvlab.traces.decision import decision_of
from kvlab.traces.sources import open_source

nb.setup()
console = Console(width=110)
stack = nb.ensure_stack(TARGET, TOPOLOGY)       # stops another topology's stack first
ranks = stack.replicas
print(f"stack {stack.id}: {len(ranks)} endpoints, gateway policy {stack.policy}")
for r in ranks:
    print(f"  {r.name:<10} replica {r.replica} rank {r.dp_rank}  {r.url}")

# %% [markdown]
# ## 1. Rank-blind vs DP-aware
# Both policies score every rank the same way (prefix ×3, queue, KV usage, in-flight requests and
# in-flight prefill tokens). **rank-blind** uses the scores only to choose the *replica*, then takes
# its ranks in turn — what happens when a wide-EP replica is one address and balances its ranks
# itself. **dp-aware** chooses the rank. Same seeded workload, caches reset before each phase.

# %%
settings = dict(workload=WORKLOAD, users=USERS, duration_s=DURATION_S, seed=SEED)
blind = nb.run_phase(stack, "rank-blind", **settings)
aware = nb.run_phase(stack, "dp-aware", **settings)
phases = {"rank-blind": blind, "dp-aware": aware}
summaries = {p: v.summary for p, v in phases.items()}
records = {p: v.records for p, v in phases.items()}
console.print(summary_table(summaries, title="rank-blind → dp-aware"))

# %%
figures.ttft_cdf(records).show()
figures.hit_rates(summaries).show()

# %% [markdown]
# ## 2. Per-rank load
# A rank that collects more than its share of uncached prompts holds up its 3 siblings: they step
# together. The peak queue per rank (sampled from each rank's own `/metrics`) shows it.

# %%
fig = go.Figure()
for i, (p, ph) in enumerate(phases.items()):
    peak = defaultdict(float)
    for s in ph.samples:
        peak[s["replica"]] = max(peak[s["replica"]], s["running"] + s["waiting"])
    names = sorted(peak)
    fig.add_trace(go.Bar(name=p, x=names, y=[peak[k] for k in names], marker_color=figures.COLORS[i]))
fig.update_layout(barmode="group", title="Peak requests on each rank (running + waiting)", template="plotly_white",
                  height=360, yaxis_title="requests")
fig.show()
figures.requests_per_replica(records).show()

# %% [markdown]
# ## 3. In the traces: the rank decision and the lockstep cost
# The gateway's schedule span says why it chose a rank (`kvlab.dp.rank_reason`: `prefix-on-rank`,
# `least-loaded-rank`, `load-over-prefix`, ...) and lists the siblings; the replica's
# `engine.moe_dispatch` span says how long the request's rank idled waiting for the busiest rank
# (`kvlab.dp.wait_busiest_ms`) and how unbalanced the experts were (`kvlab.moe.imbalance`).

# %%
source = open_source(run_dir=Path(stack.run_dir), jaeger=stack.jaeger)
reasons = defaultdict(Counter)
wait = defaultdict(list)
imbalance = defaultdict(list)
example = None
for t in source.traces():
    d = decision_of(t)
    if d is None or d.policy not in phases:
        continue
    schedule = t.first(n.SPAN_SCHEDULE)
    reasons[d.policy][schedule.attr(n.DP_REASON)] += 1
    for span in t.find(n.SPAN_ENGINE_MOE_DISPATCH):
        wait[d.policy].append(float(span.attr(n.DP_WAIT_MS) or 0.0))
        imbalance[d.policy].append(float(span.attr(n.MOE_IMBALANCE) or 1.0))
    if d.policy == "dp-aware" and schedule.attr(n.DP_REASON) == "prefix-on-rank":
        example = (t, schedule)
print({p: dict(c) for p, c in reasons.items()})

fig = go.Figure([go.Box(y=wait[p], name=p, marker_color=figures.COLORS[i], boxpoints=False)
                 for i, p in enumerate(phases)])
fig.update_layout(title="Time each request's rank idled for the busiest DP rank (per request)",
                  yaxis_title="kvlab.dp.wait_busiest_ms", template="plotly_white", height=360)
fig.show()
print({p: f"mean EP imbalance {np.mean(v):.2f}" for p, v in imbalance.items() if v})
print({p: f"rank idle per request: mean {np.mean(v):.0f} ms, median {np.median(v):.0f} ms" for p, v in wait.items() if v})

# %% [markdown]
# DP-aware routing balances the prefill work *per rank* (`inflight_tokens`), so on a machine with
# CPU to spare most of its requests' ranks barely idle, while rank-blind ones wait for a busier
# sibling. Under CPU contention the simulator's steps stretch, fewer requests overlap and the
# difference shrinks or flips: the idle time is a consequence of the load, not a constant of the
# policy, so it is shown here rather than checked. Compare the two medians printed above.

# %%
trace, schedule = example
siblings = schedule.json_attr(n.DP_SIBLINGS, [])
console.print(f"trace {trace.trace_id}: rank {schedule.attr(n.DP_RANK)} of {schedule.attr(n.DP_REPLICA)}, "
              f"reason {schedule.attr(n.DP_REASON)}")
for s in siblings:
    print(f"  rank {s.get('rank')} {s.get('name', ''):<10} cached prefix {s.get('prefix_tokens'):>5} tokens · "
          f"waiting {s.get('waiting')} · in-flight prefill tokens {s.get('inflight_tokens')} · total {s.get('total')}")

# %% [markdown]
# ## 4. Autoscaling under a load ramp
# The gateway already scrapes every replica's queue and KV usage, so it publishes how many replicas
# the load needs (`kvlab_gateway_desired_replicas`, `GET /debug/autoscale`) with the Kubernetes HPA
# rule on two signals: `ceil(current × max(waiting per replica / target, KV usage / target))`,
# immediate scale-up, scale-down only after a window. Locally a scaler starts and stops simulator
# replicas to follow it (on a cluster: an HPA or KEDA on that metric).
#
# `kvlab lab --topology autoscale` runs it on its own stack (one replica that queues early), so the
# wide-EP stack is stopped first to give it the CPU.

# %%
nb.stop_stack(Path(stack.run_dir))
run = nb.run_lab(["--topology", "autoscale", "--duration", str(RAMP_S), "--users", str(RAMP_USERS),
                  "--seed", str(SEED)], "autoscale")
result = read_run(run / "summary.json").autoscale
phase_dir = next(run.glob("phase-1-*"))
data = json.loads((phase_dir / "autoscale.json").read_text())
autoscale_figure(data, read_records(phase_dir / "requests.jsonl")).show()
print({k: result[k] for k in ("desired_first", "desired_peak", "desired_last", "scale_ups", "scale_downs", "reasons")})
print("TTFT by replicas running:", result["ttft_by_running_replicas"])

# %% [markdown]
# The scale actions are spans too (`stack.scale`, with direction, from/to replicas and how long the
# new replica took to be ready), next to the gateway's `gateway.autoscale` recommendation changes:

# %%
scale_spans = [s for t in open_source(run_dir=run).traces() for s in t.spans
               if s.name in (n.SPAN_SCALE_ACTION, n.SPAN_AUTOSCALE)]
for s in scale_spans[:12]:
    keys = (n.SCALE_DIRECTION, n.SCALE_FROM, n.SCALE_TO, n.SCALE_READY_MS, n.AUTOSCALE_DESIRED,
            n.AUTOSCALE_CURRENT, n.AUTOSCALE_REASON)
    print(f"{s.service:<15} {s.name:<18}", {k.split('.')[-1]: s.attributes[k] for k in keys if k in s.attributes})

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - both phases complete without errors
# - DP-aware: delivered hit rate +15 points, more requests a second, ranks picked for their prefix
# - the autoscaling recommendation rises with the load, a replica is started, scale actions are traced

# %%
b, a = summaries["rank-blind"], summaries["dp-aware"]
assert a.errors == 0 and b.errors == 0, "both phases should complete cleanly"
assert a.hit_rate.delivered > b.hit_rate.delivered + 0.15, "DP-aware should reuse far more cache"
assert a.rps > b.rps, "DP-aware should serve more requests a second than rank-blind"   # its p50 can be a miss on a slow machine
assert reasons["dp-aware"]["prefix-on-rank"] > 0, "DP-aware should pick ranks for their prefix"
assert result["desired_peak"] > result["desired_first"], "the recommendation should rise with the load"
assert result["scale_ups"] >= 1, "the scaler should have started a replica"
assert any(s.name == n.SPAN_SCALE_ACTION for s in scale_spans), "scale actions should be traced"
print(f"✓ DP-aware: delivered hit rate {b.hit_rate.delivered:.0%} → {a.hit_rate.delivered:.0%}, "
      f"{b.rps:.2f} → {a.rps:.2f} requests/s (TTFT p50 {b.ttft_ms.p50:.0f} → {a.ttft_ms.p50:.0f} ms); autoscaling "
      f"{result['desired_first']} → {result['desired_peak']} → {result['desired_last']} replicas")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | `kvlab up failed` for `wide-ep` | 8 rank servers start; read `runs/<id>/logs/engine-moe.log`. |
# | DP-aware not better | with very short phases both policies are still warming their caches: raise `DURATION_S`. |
# | DP-aware ranks idle as much as rank-blind ones | the machine is busy (other jobs): the rank idle time follows the load, see section 3. |
# | no `engine.moe_dispatch` spans | the profile has no `moe:` section (`cpu-tiny-moe` has one, docs/wide-ep.md). |
# | no scale-up | the ramp was too gentle for `target_waiting: 2` on this machine: raise `RAMP_USERS`; `runs/<id>-autoscale/lab.log` has the lab's own view. |
# | no scale-down | the load ended less than `scale_down_window_s` before the run did; the lab waits window + 10 s for it. |
