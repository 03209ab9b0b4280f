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
# # Lab 10 · Experiments that each move one number
#
# **Objectives**
# 1. **Control**: a workload with nothing to reuse (`random`): kv-aware routing has nothing to
#    find, its hit rate stays at round-robin's (~0).
# 2. **Cache-size sweep**: grow every replica's KV cache until all prompt groups fit; round-robin's
#    delivered hit rate catches up with kv-aware's.
# 3. **One hot prompt group**: pure prefix affinity piles it onto one replica; kv-aware's load
#    scorers spread it.
# 4. **Eviction**: a cache smaller than even kv-aware's working set; compare what each index
#    predicted with what the replicas delivered (predicted − delivered).
# 5. **Users ladder**: 2 → 16 users; the cache-blind router stops scaling, kv-aware keeps going.
#
# Each experiment is a topology in `labs/topologies/` that `kvlab lab --topology T --quick` runs on
# its own (docs/experiments.md); here each gets a fresh stack and short phases. The checkpoints
# assert the direction of each effect with counts that a busy machine does not turn around (hit
# rates, predicted − delivered, requests per replica); only the ladder reads a rate (requests per
# second), with a wide margin.
#
# **Time:** about 6 minutes (6 stacks; 10 phases of 10 s, 4 of 20 s).
# **Stack:** starts one stack per experiment, each stopping the one before (lab 09's first); the
# last keeps running.

# %% tags=["parameters"]
TARGET = "local"             # local only: the experiments size the simulator's caches
USERS = 8
DURATION_S = 10.0            # per phase
MIN_REQUESTS = 80            # a phase also runs until this many completed (a busy machine starts Locust slowly)
SEED = 0
CACHE_BLOCKS = [160, 640]   # the sweep: ~2 and all 8 of the cache-sweep groups per replica; add 320 (~4) for the curve's middle
HOT_USERS = 12               # section 3: ~10 users on the hot group's holder, which has 4 running slots
LADDER = [2, 16]             # users; add 4 and 8 for the full curve (docs/experiments.md)
LADDER_S = 20.0              # per ladder phase: kv-aware first prefills each of the 32 groups once

# %%
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from rich.console import Console
from rich.table import Table

from kvlab import notebook as nb
from kvlab.report import figures
from kvlab.scenarios import experiments as ex

runs = nb.setup()
console = Console(width=110)


def experiment(name, users=USERS, duration_s=DURATION_S, min_requests=MIN_REQUESTS, **sim):
    """Start the stack of topology `name` (with these `sim:` settings changed: a sweep point), run
    one phase per policy it compares (ex.EXPERIMENTS) on its own workload; {policy: phase}."""
    topology = ex.variant(name, runs / "experiments", **sim) if sim else name
    stack = nb.ensure_stack(TARGET, str(topology))
    workload = ex.topology(name).workload
    return {p: nb.run_phase(stack, p, workload=workload.name, params=workload.params, users=users,
                            duration_s=duration_s, seed=SEED, min_requests=min_requests) for p in ex.EXPERIMENTS[name]}


def show(title, phases, *columns):
    """A table: one row per policy, the hit rates and the experiment's own columns (name, function)."""
    table = Table(title=title)
    for c in ("policy", "requests", "TTFT p50 ms", "available", "predicted", "delivered", *(c[0] for c in columns)):
        table.add_column(c, justify="right")
    for p, v in phases.items():
        s = v.summary
        table.add_row(p, str(s.ok), f"{s.ttft_ms.p50 or 0:.0f}",
                      *(f"{getattr(s.hit_rate, k) or 0:.0%}" for k in ("available", "predicted", "delivered")),
                      *(f(v) for _, f in columns))
    console.print(table)


# %% [markdown]
# ## 1. The control: nothing to reuse
# `labs/topologies/control.yaml`: the `random` workload, every prompt new. A KV-aware router can
# only win by finding cache; here there is none, so its hit rates must stay at round-robin's. If
# they did not, the measurement (not the routing) would be wrong.

# %%
control = experiment("control")
show("control: random prompts", control)

# %% [markdown]
# ## 2. Cache-size sweep: round-robin catches up once everything fits
# `labs/topologies/cache-sweep.yaml`: 8 prompt groups of ~63 blocks, 4 replicas; the number moved
# is `num_blocks` per replica. At 160 blocks a replica holds ~2 groups: what kv-aware gives it, a
# quarter of what round-robin sends it. At 640 it holds all 8, and round-robin pays only one cold
# prefill per group and replica. Those first visits ("compulsory" misses: 8 groups × 4 replicas for
# round-robin, 8 for kv-aware) weigh a lot in a short phase, so the *warm* hit rate leaves them out:
# it is what the cache size decides (`ex.warm_delivered`; dotted: every request).

# %%
sweep = {blocks: experiment("cache-sweep", num_blocks=blocks) for blocks in CACHE_BLOCKS}
warm = {b: {p: ex.warm_delivered(v.records) for p, v in sweep[b].items()} for b in CACHE_BLOCKS}
fig = go.Figure()
for i, policy in enumerate(ex.EXPERIMENTS["cache-sweep"]):
    fig.add_trace(go.Scatter(x=CACHE_BLOCKS, y=[warm[b][policy] for b in CACHE_BLOCKS], name=f"{policy}: warm",
                             mode="lines+markers", line_color=figures.COLORS[i]))
    fig.add_trace(go.Scatter(x=CACHE_BLOCKS, y=[ex.delivered(sweep[b][policy].summary) for b in CACHE_BLOCKS],
                             name=f"{policy}: all requests", mode="lines+markers",
                             line=dict(color=figures.COLORS[i], dash="dot")))
fig.update_layout(title="Delivered hit rate vs KV cache per replica", xaxis_title="KV blocks per replica",
                  yaxis_title="delivered hit rate", yaxis_tickformat=".0%", template="plotly_white", height=340)
fig.show()
gap = {b: warm[b]["kv-aware"] - warm[b]["round-robin"] for b in CACHE_BLOCKS}
print("kv-aware's lead in warm hit rate:", {b: f"{g:+.0%}" for b, g in gap.items()})

# %% [markdown]
# ## 3. One hot prompt group
# `labs/topologies/hot-group.yaml`: 80 % of the requests ask group 0 (`hot_share` of the
# `shared-prefix` workload), each with a long new question, so the hot group is real prefill work;
# each replica runs 4 requests at a time. `kv-aware-affinity` scores the prefix only: every hot
# request goes to the replica holding it, where they queue. `kv-aware` adds queue, in-flight and
# predicted-TTFT scorers: once the holder queues, another replica wins, prefills the group's
# system prompt once and shares the hot group from then on.

# %%
hot = experiment("hot-group", users=HOT_USERS)
show("one hot group", hot, ("busiest replica", lambda v: f"{ex.busiest_share(v.summary):.0%}"),
     ("hot group on", lambda v: " ".join(f"{r} {s:.0%}" for r, s in ex.group_replicas(v.records, "g0").items())))
fig = go.Figure()
for i, (policy, v) in enumerate(hot.items()):
    counts = v.summary.replicas
    fig.add_trace(go.Bar(x=list(counts), y=[c / sum(counts.values()) for c in counts.values()], name=policy,
                         marker_color=figures.COLORS[i]))
fig.update_layout(barmode="group", title="Share of requests per replica", yaxis_tickformat=".0%",
                  template="plotly_white", height=320)
fig.show()

# %% [markdown]
# ## 4. Eviction: what each index predicted, what the replicas delivered
# `labs/topologies/eviction.yaml`: 16 groups, 160 blocks per replica; even perfect affinity leaves
# each replica 4 groups for room for ~2.5, so blocks are evicted all the time. The gap
# `predicted − delivered` is the cache a router counted on that the replica no longer (or never)
# held. `prefix` learns its index from its own routing decisions, an LRU per replica bounded by the
# cache size the replica reports, so it forgets about what the replica evicts. `kv-aware` follows the
# replicas' KV events and also counts the blocks it has just routed as *speculative* until the
# replica's `BlockStored` confirms them (so a burst of one group finds its first request's blocks);
# under eviction some of those are gone before they are used. Compare with section 2's 640-block
# point, where nothing is evicted.

# %%
evict = experiment("eviction")
show("under eviction", evict, ("predicted − delivered", lambda v: f"{ex.undelivered(v.summary):+.1%}"),
     ("speculative", lambda v: f"{v.summary.hit_rate.speculative or 0:.1%}"))
roomy = sweep[CACHE_BLOCKS[-1]]["kv-aware"].summary
print(f"kv-aware without eviction ({CACHE_BLOCKS[-1]} blocks): predicted − delivered {ex.undelivered(roomy):+.1%}")

# %% [markdown]
# ## 5. Users ladder: where the cache-blind router collapses
# `labs/topologies/users-ladder.yaml`: the quickstart's shape (32 groups of ~1,870 tokens, 1,400
# blocks per replica: ~12 groups fit) at half the simulator's time. One stack, a round-robin and a
# kv-aware phase per rung, `LADDER_S` long: kv-aware's first pass over the 32 groups is 32 full
# prefills, which would fill a 10-s phase. Round-robin recomputes most of every prompt, so its
# replicas are busy with prefill and each added user mostly waits: its requests per second stop
# growing with the users (and its TTFT tail climbs). kv-aware prefills ~50 new tokens a request and
# keeps scaling.

# %%
ladder = {u: experiment("users-ladder", users=u, duration_s=LADDER_S, min_requests=0) for u in LADDER}   # rates: fixed length
fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT p50 (ms)", "requests per second"))
for i, policy in enumerate(ex.EXPERIMENTS["users-ladder"]):
    fig.add_trace(go.Scatter(x=LADDER, y=[ladder[u][policy].summary.ttft_ms.p50 for u in LADDER],
                             name=policy, mode="lines+markers", line_color=figures.COLORS[i]), row=1, col=1)
    fig.add_trace(go.Scatter(x=LADDER, y=[ladder[u][policy].summary.rps for u in LADDER], showlegend=False,
                             mode="lines+markers", line_color=figures.COLORS[i]), row=1, col=2)
fig.update_xaxes(title_text="users", type="log")
fig.update_layout(template="plotly_white", height=340)
fig.show()
scaling = {p: ladder[LADDER[-1]][p].summary.rps / ladder[LADDER[0]][p].summary.rps
           for p in ex.EXPERIMENTS["users-ladder"]}
print(f"{LADDER[-1] / LADDER[0]:.0f}× the users gave", {p: f"{g:.1f}× the requests per second" for p, g in scaling.items()})

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - control: both hit rates < 5 %, within 3 points of each other
# - sweep: kv-aware's lead > 30 points at 160 blocks; at 640 under half that and < 10 points; round-robin's
#   warm hit rate climbs > 30 points
# - hot group: affinity keeps it on one replica (> 95 %), its busiest replica > 75 %; kv-aware's busiest 20
#   points less, the group on ≥ 2 replicas
# - eviction: kv-aware's predicted − delivered above prefix's and above a roomy cache's
# - ladder: from the first rung to the last, round-robin's requests per second grow by under 0.6 of the
#   users' factor (2 → 16 users: under 4.8×); on the last rung kv-aware serves over 1.2× round-robin's
#
# Directions, not values: each holds with the machine busy (the phases then serve fewer requests).

# %%
rr, kv = control["round-robin"].summary, control["kv-aware"].summary
assert all(v.summary.errors == 0 for e in (control, hot, evict) for v in e.values()), "phases with errors"
assert ex.delivered(rr) < 0.05 and ex.delivered(kv) < 0.05, "random prompts share nothing: both hit rates ~0"
assert abs(ex.delivered(kv) - ex.delivered(rr)) < 0.03, "with nothing to reuse kv-aware finds nothing more"
small, large = CACHE_BLOCKS[0], CACHE_BLOCKS[-1]
assert gap[small] > 0.3, f"with a small cache kv-aware should reuse far more: {gap}"
assert gap[large] < gap[small] / 2, f"once every group fits, round-robin should catch up: {gap}"
assert gap[large] < 0.1, f"once every group fits, round-robin's warm hit rate should be kv-aware's: {gap}"
rr_hits = [warm[b]["round-robin"] for b in CACHE_BLOCKS]
assert rr_hits[-1] > rr_hits[0] + 0.3, f"round-robin's warm hit rate should climb with the cache: {rr_hits}"
affinity, aware = hot["kv-aware-affinity"], hot["kv-aware"]
assert max(ex.group_replicas(affinity.records, "g0").values()) > 0.95, \
    f"affinity keeps the hot group on one replica: {ex.group_replicas(affinity.records, 'g0')}"
assert ex.busiest_share(affinity.summary) > 0.75, "affinity's busiest replica should serve most requests"
assert ex.busiest_share(aware.summary) < ex.busiest_share(affinity.summary) - 0.2, \
    "kv-aware's load scorers should take work off the hot replica"
assert len(ex.group_replicas(aware.records, "g0")) >= 2, "kv-aware should spread the hot group"
stale = {p: ex.undelivered(v.summary) for p, v in evict.items()}
assert stale["kv-aware"] > 0.01 and stale["kv-aware"] > stale["prefix"] + 0.01, \
    f"under eviction kv-aware's speculative blocks should predict cache that is gone: {stale}"
assert stale["kv-aware"] > ex.undelivered(roomy) + 0.01, "the gap should come with eviction"
top = {p: ladder[LADDER[-1]][p].summary.rps for p in ex.EXPERIMENTS["users-ladder"]}
assert scaling["round-robin"] < 0.6 * LADDER[-1] / LADDER[0], f"round-robin should stop scaling: {scaling}"
assert top["kv-aware"] > 1.2 * top["round-robin"], f"at the top rung kv-aware should serve more: {top}"
print(f"✓ control {ex.delivered(rr):.0%} vs {ex.delivered(kv):.0%}; sweep lead {gap[small]:+.0%} → {gap[large]:+.0%}; "
      f"hot busiest {ex.busiest_share(affinity.summary):.0%} → {ex.busiest_share(aware.summary):.0%}; "
      f"predicted − delivered prefix {stale['prefix']:+.1%} kv-aware {stale['kv-aware']:+.1%}; "
      f"{LADDER[0]}→{LADDER[-1]} users: rps ×{scaling['round-robin']:.1f} vs ×{scaling['kv-aware']:.1f}")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | control: hit rates above 0 | the workload is not `random` (a `--workload` override?); `kvlab status` shows the stack's topology. |
# | sweep: round-robin does not catch up | the largest point must hold all 8 groups (~70 blocks each with questions): raise the last of `CACHE_BLOCKS`; short phases end before every group is warm everywhere: raise `DURATION_S`. |
# | hot group: kv-aware keeps it on one replica | the holder never queued: fewer users than its running slots; raise `HOT_USERS`. |
# | eviction: no predicted − delivered | the cache holds kv-aware's working set (check `num_blocks` in the topology) or the phase was too short to evict; raise `DURATION_S`. |
# | ladder: both scale alike | the machine itself is saturated (Locust and the gateway share 2 cores): close other jobs, or run `kvlab lab --topology users-ladder --users 16` (25 s phases). |
