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
# # Lab 03 · Dashboards: what to watch in production
#
# **Objectives**
# 1. Find the before/after **HTML report** of your run (local) and the **Grafana** dashboards (kind).
# 2. Read the dashboards' panels — the exact PromQL Grafana runs — over the window of labs 01–02.
# 3. Learn which few signals tell you, in production, whether KV-aware routing is paying off and
#    what to do when it is not.
#
# **Time:** about 10 s after labs 01–02 (about 60 s alone: it runs two short phases first).
# **Stack:** reuses lab 00's `quickstart` stack (4 replicas) and labs 01–02's phases; starts the
# stack and runs both phases if missing.

# %% tags=["parameters"]
TARGET = "local"             # local | kind-cpu | kind-gpu
TOPOLOGY = "quickstart"
WORKLOAD = "shared-prefix"
USERS = 8
DURATION_S = 25.0            # used only when the run directory has no phases yet
SEED = 0

# %%
import time
from pathlib import Path

import numpy as np
from IPython.display import FileLink, display

from kvlab import notebook as nb
from kvlab.report import write_report
from kvlab.report.html import headline

nb.setup()
stack = nb.ensure_stack(TARGET, TOPOLOGY)
run_dir = Path(stack.run_dir)
settings = dict(workload=WORKLOAD, users=USERS, duration_s=DURATION_S, seed=SEED)
phases = {p: nb.phase(stack, p, **settings) for p in ("round-robin", "kv-aware")}
dashboards = Path(nb.__file__).resolve().parents[2] / "dashboards"     # the repository's dashboards/

# %% [markdown]
# ## 1. The HTML report
# `kvlab lab` (and lab 02) write `runs/<id>/report.html`: the before/after table, TTFT CDFs, the
# hit-rate decomposition, throughput and requests per replica — one file with plotly.js inlined, so
# it opens offline and can be attached to a ticket.

# %%
report = run_dir / "report.html"
if not report.exists():
    write_report(report, phases,
                 {"run": run_dir.name, "workload": WORKLOAD, "seed": SEED, "users": USERS})
print(headline({p: v.summary for p, v in phases.items()}))
display(FileLink(str(report.relative_to(Path.cwd())) if report.is_relative_to(Path.cwd()) else str(report)))

# %% [markdown]
# ## 2. Grafana
# `dashboards/*.json` are generated from code (`kvlab dashboards`) and provisioned into Grafana:
#
# | dashboard | what it answers |
# |---|---|
# | **kvlab · Before / after** | is TTFT lower and throughput higher with this policy? |
# | **kvlab · Routing** | where do requests go, why (decisions by reason), and how much cache is lost to routing vs to the index? |
# | **kvlab · Replicas** | is any engine queueing, out of KV space, preempting? |
# | **kvlab · P/D and data parallel** | split vs unified decisions, KV transfer time, per-rank load (labs 05–06) |
#
# On kind, Grafana is published on 127.0.0.1:30300. Locally, the stack's Prometheus scraped every
# replica and gateway during the labs; below, the same panels are drawn from it with the same queries
# (to browse them in Grafana, see "Provisioning" in docs/observability.md).

# %%
uids = {"before-after": "kvlab-before-after", "routing": "kvlab-routing", "replicas": "kvlab-replicas",
        "pd-dp": "kvlab-pd-dp"}
if stack.grafana:
    for name, uid in uids.items():
        print(f"{name:<13} {stack.grafana}/d/{uid}")
print("prometheus:", stack.prometheus or "not running (install the `prometheus` binary to get metrics locally)")

# %%
records = [r for v in phases.values() for r in v.records]
start = min(r.ts for r in records) - 2
end = max(r.ts + (r.e2e_ms or 0) / 1000 for r in records) + 4
panels = [("before-after", "TTFT p50 / p95 by policy (gateway)"),
          ("routing", "Available / predicted / delivered hit rate"),
          ("routing", "Decisions by reason"),
          ("replicas", "Engine prefix-cache hit rate"),
          ("replicas", "Waiting (queue)")]
shown = {}
if stack.prometheus:
    time.sleep(max(0.0, end - time.time()))          # let the last scrapes of the window land
    for board, title in panels:
        fig = nb.dashboard_panel(stack.prometheus, dashboards / f"{board}.json", title, start, end)
        shown[title] = fig
        fig.show()

# %% [markdown]
# ## 3. What to watch in production
#
# | signal (panel) | healthy | when it is not |
# |---|---|---|
# | **TTFT p95 by policy** (Before / after) | stable, well below your SLO | a rising tail with a flat hit rate is queueing: add replicas (lab 06's autoscaling signal) |
# | **available − predicted**, "cache lost to routing" (Routing) | near 0 for kv-aware | load scorers overrule the prefix too often (lab 04's `load-over-prefix`): the pool is saturated, or the weights favour load too much |
# | **predicted − delivered**, "lost to index / eviction" (Routing) | near 0 | the index is stale (KV-event stream disconnected: see **KV-event gaps** and index blocks) or caches evict before reuse (KV too small for the working set) |
# | **Engine prefix-cache hit rate** (Replicas) | high and even across replicas | one replica low = it gets the cold groups; all low = the working set does not fit the fleet's KV |
# | **Waiting (queue)** and **KV-cache usage** (Replicas) | short queues, usage below ~90 % | one hot replica = a popular prefix pinned to it: prefix-aware load scores (or replicate hot prefixes) |
# | **Decisions by reason** (Routing) | mostly `prefix` | many `load-over-prefix` = saturation; many `load` = prompts share little (routing cannot help: the `random` workload) |
# | **Endpoint health, retries, ejections, upstream errors** (Routing) | flat zero | a failing replica; the gateway ejects and retries, but capacity is down |
#
# Alert on the *gaps* (cache lost to routing, to the index) and on TTFT p95, not on the raw hit
# rate: the hit rate depends on the workload, the gaps on your routing.

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - the report embeds plotly
# - with Prometheus: the TTFT-by-policy panel has kv-aware; kv-aware's delivered hit rate > 40 % and above
#   round-robin's; the engines' hit-rate panel has series

# %%
assert report.exists() and "plotly" in report.read_text()[:200_000].lower(), "the report should embed plotly"
if stack.prometheus:
    ttft = shown["TTFT p50 / p95 by policy (gateway)"]
    names = {t.name for t in ttft.data}
    assert any(x.startswith("kv-aware") for x in names), f"the gateway's TTFT by policy should include kv-aware: {names}"
    def finite_mean(ys):   # a rate window where nothing was served gives NaN, not a hit rate
        ys = np.array(ys, dtype=float)
        return float(np.mean(ys[np.isfinite(ys)])) if np.isfinite(ys).any() else float("nan")
    hit = {t.name: finite_mean(t.y) for t in shown["Available / predicted / delivered hit rate"].data}
    assert hit.get("kv-aware delivered", 0) > 0.4, f"the kv-aware delivered hit rate should show in Prometheus: {hit}"
    if "round-robin delivered" in hit:   # averaged over each phase's points
        assert hit["kv-aware delivered"] > hit["round-robin delivered"], f"kv-aware should deliver more cache: {hit}"
    assert shown["Engine prefix-cache hit rate"].data, "the engines' hit rate should have series"
print("✓ report written; dashboards read from the stack's Prometheus" if stack.prometheus else "✓ report written")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | `prometheus: not running` | `apt-get install prometheus` (kvlab runs its own on a free port; stop the system service on :9090 if it starts) and start a new stack (`kvlab down`, re-run lab 00). |
# | a panel with no series | the window holds no traffic (run labs 01–02 first), or the metric belongs to a part not running yet (the P/D and autoscaling panels fill once labs 05–06 run). |
# | round-robin missing from gateway panels | its gateway ran before Prometheus was up (Prometheus follows `runs/<id>/prometheus/targets/gateway.json`): re-run labs 01–02. |
# | Grafana "No data" (kind) | Prometheus targets on http://127.0.0.1:30090/targets must be UP (docs/kind.md). |
#
# The stack keeps running: lab 04 reads the traces of the same two phases.
