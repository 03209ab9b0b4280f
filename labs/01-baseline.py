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
# # Lab 01 · The cache-blind baseline
#
# **Objectives**
# 1. Load-test the replicas behind a **round-robin** load balancer — what a Kubernetes Service or
#    any cache-blind proxy does — with a seeded Locust workload.
# 2. Look at per-replica load, each engine's prefix-cache hit rate and the time to first token (TTFT).
# 3. Measure how much KV cache was **available** somewhere in the fleet but **not used** because the
#    balancer ignored it. That gap is what lab 02 recovers.
#
# **Time:** about 40 s (a 25 s load test).
# **Stack:** reuses lab 00's `quickstart` stack (4 replicas); starts it if none runs, and leaves it
# running for lab 02.

# %% tags=["parameters"]
TARGET = "local"             # local | kind-cpu | kind-gpu
TOPOLOGY = "quickstart"
WORKLOAD = "shared-prefix"   # shared-prefix | multi-turn | long-doc-qa | random
USERS = 8                    # concurrent Locust users (the lab's --quick setting)
DURATION_S = 25.0            # seconds of load (kvlab lab: 60; --quick: 25)
SEED = 0                     # lab 02 replays the same seeded stream

# %%
import numpy as np
import plotly.graph_objects as go

from kvlab import notebook as nb
from kvlab.load.workloads import create
from kvlab.report import figures

nb.setup()
stack = nb.ensure_stack(TARGET, TOPOLOGY)
print(f"stack {stack.id}: {len(stack.replicas)} replicas, gateway {stack.gateway}")

# %% [markdown]
# ## 1. The workload
# `shared-prefix` is the shape of llm-d's benchmark: many *groups* of requests, each group a long
# system prompt (~1,800 tokens) plus one of several short questions. Requests of the same group
# share their first ~117 KV blocks — if they land where those blocks are cached.
# The stream is deterministic: the seed fixes every prompt and its order.

# %%
workload = create(WORKLOAD, seed=SEED)
print(workload.describe())

# %% [markdown]
# ## 2. Run the baseline
# Every replica's prefix cache is reset first (`POST /reset_prefix_cache`), so the phase starts cold.
# A gateway with `--policy round-robin` goes in front of the same replicas: it sends request *i* to
# replica *i mod 4* — but it still **scores every request in shadow**, so it can tell us afterwards
# how much cache it ignored. Locust then replays the workload headless (`kvlab bench`).
# Results land in `runs/<id>/phase-N-round-robin/`, like `kvlab lab` writes them.

# %%
base = nb.run_phase(stack, "round-robin", workload=WORKLOAD, users=USERS, duration_s=DURATION_S, seed=SEED)
s = base.summary
print(f"{s.ok} requests ok, {s.errors} errors, {s.rps:.1f} req/s, "
      f"TTFT p50 {s.ttft_ms.p50:.0f} ms, p95 {s.ttft_ms.p95:.0f} ms")

# %% [markdown]
# ## 3. Per-replica load
# Round-robin is perfectly *fair*: every replica gets the same number of requests. The queue depth
# sampled from each replica's `/metrics` (`vllm:num_requests_running` + `vllm:num_requests_waiting`)
# shows how busy each one was.

# %%
figures.requests_per_replica({"round-robin": base.records}).show()

samples = base.samples
fig = go.Figure()
for name in sorted({x["replica"] for x in samples}):
    pts = [x for x in samples if x["replica"] == name]
    fig.add_trace(go.Scatter(x=[p["t"] for p in pts], y=[p["running"] + p["waiting"] for p in pts],
                             mode="lines", name=name, line_shape="hv"))
fig.update_layout(title="Requests on each replica (running + waiting), sampled every second",
                  xaxis_title="seconds since the phase started", yaxis_title="requests", template="plotly_white",
                  height=360)
fig.show()

# %% [markdown]
# ## 4. Engine hit rates
# Each engine counts the prompt tokens it looked up in its prefix cache and how many it found
# (`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`). With 32 groups and room for
# ~12 groups' prefixes per replica, a replica that sees *every* group keeps evicting what it will
# need next.

# %%
engines = base.engines
names = sorted(engines)
engine_hit = {k: (v["hits"] / v["queries"] if v["queries"] else 0.0) for k, v in engines.items()}
fig = go.Figure(go.Bar(x=names, y=[engine_hit[k] for k in names], marker_color="#d62728",
                       text=[f"{engine_hit[k]:.0%}" for k in names], textposition="outside"))
fig.update_layout(title="Engine prefix-cache hit rate during the baseline (tokens found / tokens looked up)",
                  yaxis_tickformat=".0%", yaxis_range=[0, 1.1], template="plotly_white", height=360)
fig.show()

# %% [markdown]
# ## 5. Time to first token
# A cache miss pays prefill for every prompt token (~0.635 ms/token on the `cpu-tiny` profile, so
# ~1,190 ms for 1,870 tokens) plus queueing; a hit only for the uncached tail. The CDF has two steps:
# the hits on the left, the misses on the right.

# %%
figures.ttft_cdf({"round-robin": base.records}).show()
figures.ttft_by_replica_over_time({"round-robin": base.records}).show()

# %% [markdown]
# ## 6. Available, but not used
# For every request the gateway reports three numbers of prompt tokens:
# **available** (the longest prefix cached on *any* replica), **predicted** (cached on the replica
# it chose) and **delivered** (what the engine reused, `usage.prompt_tokens_details.cached_tokens`).
# available − predicted is cache lost to routing: here, to cache-blindness.

# %%
figures.hit_rates({"round-robin": s}).show()
ok = [r for r in base.records if not r.error]
lost = sum((r.available_tokens or 0) - (r.predicted_tokens or 0) for r in ok)
prompt = sum(r.prompt_tokens for r in ok)
hr = s.hit_rate
if hr.available is not None:
    print(f"available {hr.available:.0%} · predicted {hr.predicted:.0%} · delivered {hr.delivered:.0%}")
    print(f"{lost:,} of {prompt:,} prompt tokens ({lost / prompt:.0%}) were cached on another replica and recomputed")

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - the load test completes without errors
# - round-robin spreads requests evenly over the replicas
# - locally: available − predicted ≥ 15 points; delivered and engine hit rates below 70 %

# %%
assert s.ok >= 20 and s.errors == 0, f"the load test should complete cleanly: {s.ok} ok, {s.errors} errors"
counts = list(s.replicas.values())
assert len(counts) == len(stack.replicas) or TARGET != "local", "every replica should have served requests"
assert max(counts) <= 1.5 * min(counts) + 2, f"round-robin should spread evenly: {s.replicas}"
if TARGET == "local":
    assert hr.available - hr.predicted >= 0.15, "a cache-blind router should leave cache on the table"
    assert hr.delivered < 0.7, "with 32 groups on 4 small caches most prompt tokens should be recomputed"
    assert np.mean(list(engine_hit.values())) < 0.7, "engine hit rates should be low under round-robin"
print(f"✓ baseline recorded in {base.dir}: TTFT p50 {s.ttft_ms.p50:.0f} ms, "
      f"delivered hit rate {hr.delivered if hr.delivered is None else format(hr.delivered, '.0%')}")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | errors > 0 | `runs/<id>/phase-N-round-robin/requests.jsonl` has the `error` of each failed request; `locust.log` Locust's view; `runs/<id>/logs/gateway-round-robin.log` the gateway's. |
# | very few requests | the machine is busy (other benchmarks?): TTFTs grow, counts shrink; re-run, or raise `DURATION_S`. |
# | hit rates `None` | no gateway headers: on kind the baseline is the plain Service, which knows nothing about caches (lab 04 explains how the gateway computes *available*). |
# | delivered high already | caches were not reset (`reset_prefix_cache` failed?) or the workload is not `shared-prefix`. |
