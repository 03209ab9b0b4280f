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
# # Lab 12 · At scale: the same routing on 4, 16 and 64 replicas
#
# **Objectives**
# 1. Take lab 02's before/after (cache-blind vs cache-aware routing) from 4 to 64 replicas with the
#    cluster twin: kvlab's own router and simulator engines in virtual time (docs/twin.md).
# 2. See where cache-aware routing stops mattering for the hit rate (the cluster's cache holds the
#    working set) and where load starts to decide instead.
# 3. See what the router's information lag costs: the same run with perfect information, with the
#    live stack's lags, with KV events 2 s late and with none at all.
#
# Every figure here is from the twin, not a live run.
#
# **Time:** about 40 s.
# **Stack:** none: the twin runs in this kernel. Lab 11's stack is still running; `kvlab down`
# stops it.

# %% tags=["parameters"]
TARGET = "local"             # the twin runs in this process: no stack
TOPOLOGY = "quickstart"
SIZES = [4, 16, 64]
REQUESTS_PER_REPLICA = 40
RATE_PER_REPLICA = 0.8       # requests/s, open loop
GROUPS = 64
SEED = 0

# %%
import msgspec
import plotly.graph_objects as go

from kvlab import notebook as nb
from kvlab.twin.runner import plans, run
from kvlab.twin.settings import Information, TwinSettings

nb.setup()
POLICIES = ["round-robin", "prefix", "kv-aware"]
results = {}
for n in SIZES:
    settings = TwinSettings(topology=TOPOLOGY, replicas=n, requests=REQUESTS_PER_REPLICA * n, rate=RATE_PER_REPLICA * n,
                            workload_params={"groups": GROUPS}, seed=SEED)
    for plan in plans(settings, POLICIES):
        r = run(plan)
        results[(n, plan.policy.name)] = r
        s = r.summary
        print(f"{n:>3} replicas · {plan.policy.name:<11} hit rate {s.hit_rate.delivered:.3f} (oracle "
              f"{r.oracle.hit_rate:.3f}) · TTFT p50 {s.ttft_ms.p50:,.0f} ms · {r.wall_s:.1f} s to simulate "
              f"{r.outcome.virtual_s:.0f} s")

# %% [markdown]
# ## Hit rate and TTFT against replica count
# The grey line is the oracle: the best hit rate any router could get from the same requests on the
# same total cache.

# %%
def by_policy(metric):
    return {p: [metric(results[(n, p)]) for n in SIZES] for p in POLICIES}


hit = by_policy(lambda r: r.summary.hit_rate.delivered)
fig = go.Figure([go.Scatter(x=SIZES, y=v, name=p, mode="lines+markers") for p, v in hit.items()])
fig.add_scatter(x=SIZES, y=[results[(n, "kv-aware")].oracle.hit_rate for n in SIZES], name="oracle",
                line={"color": "#bbbbbb", "dash": "dash"})
fig.update_layout(title="Delivered hit rate vs replicas (twin)", xaxis={"title": "replicas", "type": "log"},
                  yaxis={"title": "hit rate", "tickformat": ".0%"})
fig.show()
fig = go.Figure()
for q in ("p50", "p95"):
    for p, v in by_policy(lambda r, q=q: getattr(r.summary.ttft_ms, q)).items():
        fig.add_scatter(x=SIZES, y=v, name=f"{p} {q}", mode="lines+markers", line={"dash": "dot" if q == "p95" else None})
fig.update_layout(title="TTFT p50 (solid) and p95 (dotted) vs replicas (twin)", xaxis={"title": "replicas", "type": "log"},
                  yaxis={"title": "ms", "type": "log"})
fig.show()
busiest = by_policy(lambda r: max(r.summary.replicas.values()) * len(r.summary.replicas) / sum(r.summary.replicas.values()))
fig = go.Figure([go.Scatter(x=SIZES, y=v, name=p, mode="lines+markers") for p, v in busiest.items()])
fig.update_layout(title="Load: the busiest replica's requests, in multiples of the mean (twin)",
                  xaxis={"title": "replicas", "type": "log"}, yaxis={"title": "busiest / mean"})
fig.show()
print({p: [f"{x:.2f}" for x in v] for p, v in busiest.items()})

# %% [markdown]
# Round-robin's hit rate does not grow with the cluster: every replica still sees every group, so
# each keeps evicting; its load stays even (busiest / mean 1.0). Cache-aware routers climb to the
# oracle once the cluster's cache holds the working set (here from 16 replicas); from there they tie
# on hit rate and on TTFT p50, and **load decides**: a group lives where its blocks are, so the
# busiest replica serves a growing multiple of the mean (the third figure), and the TTFT p95 follows
# it. kv-aware's load terms do not even it out at this rate: read its busiest share against prefix's.
#
# At the smallest size the cache holds only part of the 64 groups, and the two cache-aware routers
# differ: kv-aware's load terms move some requests off the replica holding their prefix. With these
# defaults that trades a little hit rate for a little balance and costs TTFT (p50 927 ms against
# prefix's 800 ms): keeping a group on its holder pays more than spreading it when every replica is
# busy with cold prefills.

# %% [markdown]
# ## What the router sees
# The live gateway learns about blocks from KV events a moment after the engine stored them, and
# reads queues from a scrape every 200 ms. It also books a prompt's blocks on the replica it chose
# the moment it routes (the speculative layer, 30 s TTL), so its own decisions stand in for events
# not yet received. Here is kv-aware at the middle size with that live-like view, with perfect
# information, and — with the speculative layer off, so the lag shows — with KV events 2 s late and
# with none at all.

# %%
n = SIZES[len(SIZES) // 2]
base = TwinSettings(topology=TOPOLOGY, replicas=n, requests=REQUESTS_PER_REPLICA * n, rate=RATE_PER_REPLICA * n,
                    workload_params={"groups": GROUPS}, seed=SEED, policy="kv-aware")

def view(**information):
    return run(plans(msgspec.structs.replace(base, information=Information(**information)), [])[0])


views = {"perfect": view(perfect=True), "live-like": results[(n, "kv-aware")],
         "events 2 s late": view(kv_event_delay_ms=2000, speculative_ttl_s=0),
         "no KV events": view(kv_event_delay_ms=1e12, speculative_ttl_s=0)}
for name, r in views.items():
    s = r.summary
    print(f"{name:<16} hit rate {s.hit_rate.delivered:.3f} · TTFT p50 {s.ttft_ms.p50:,.0f} ms p95 {s.ttft_ms.p95:,.0f} ms")
fig = go.Figure(go.Bar(x=list(views), y=[r.summary.hit_rate.delivered for r in views.values()]))
fig.update_layout(title=f"kv-aware's hit rate by what it sees, {n} replicas (twin)", yaxis={"tickformat": ".0%"})
fig.show()

# %% [markdown]
# The live stack's lags cost nothing here: perfect and live-like route alike. Without the
# speculative layer the lag starts to cost: events 2 s late lose a few points of hit rate (a group's
# next request arrives before its blocks are known and goes elsewhere), and with no events at all the
# precise router is blind and falls to round-robin's hit rate and TTFT. Try `view(kv_event_delay_ms=1e12)`
# (speculation back on): its own bookings then carry it almost all the way (docs/twin.md, "What the
# router sees").

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - prefix and kv-aware beat round-robin's hit rate by > 20 points at every size
# - at the largest size kv-aware reaches 90 % of the oracle, and round-robin's TTFT p50 is higher
# - perfect information does no worse than the live-like view (within 2 points); the live-like view
#   beats events 2 s late, and with no KV events the hit rate falls by more than 20 points

# %%
for n in SIZES:
    rr = results[(n, "round-robin")].summary.hit_rate.delivered
    for p in ("prefix", "kv-aware"):
        assert results[(n, p)].summary.hit_rate.delivered > rr + 0.2, f"{p} does not beat round-robin at {n} replicas"
big = SIZES[-1]
assert results[(big, "kv-aware")].summary.hit_rate.delivered >= 0.9 * results[(big, "kv-aware")].oracle.hit_rate, \
    "kv-aware is far from the oracle with the working set cached"
assert results[(big, "round-robin")].summary.ttft_ms.p50 > results[(big, "kv-aware")].summary.ttft_ms.p50
hit_by_view = {name: r.summary.hit_rate.delivered for name, r in views.items()}
assert hit_by_view["perfect"] >= hit_by_view["live-like"] - 0.02, hit_by_view
assert hit_by_view["live-like"] > hit_by_view["events 2 s late"] > hit_by_view["no KV events"], hit_by_view
assert hit_by_view["no KV events"] < hit_by_view["live-like"] - 0.2, hit_by_view
print("✓ cache-aware routing beats round-robin at every size and reaches the oracle once the cache holds the "
      "working set")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | slow | lower `REQUESTS_PER_REPLICA` or drop 64 from `SIZES`; the twin's speed is in docs/benchmarks.md. |
# | every TTFT in seconds | the offered rate is over what the replicas serve: lower `RATE_PER_REPLICA`. |
# | hit rates all near the oracle | the cache holds every group even at 4 replicas: raise `GROUPS`. |
#
# Lab 11's stack is still running: `kvlab down` stops it when you are done with the labs
# (`nb.stop_stack()` from here).
