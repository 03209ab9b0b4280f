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
# # Lab 00 · Setup: pick a target, start the stack, send two requests
#
# **Objectives**
# 1. Check that this kernel has everything the labs need (kvlab, plotly, the optional binaries).
# 2. Choose where the lab runs — `local` processes (the default, no GPU, no Docker), `kind-cpu` or
#    `kind-gpu` — by changing **one** parameter.
# 3. Start the stack (model-server replicas, the KV-aware gateway, traces, metrics) and check its health.
# 4. Send the same prompt twice and watch the second one reuse the first one's KV cache.
#
# **Time:** about 15 s.
# **Stack:** starts the `quickstart` stack (4 replicas) with `kvlab up`, or reuses one already running,
# and leaves it running: labs 01–04 use it through `runs/latest/stack.json` (each starts it if
# nothing runs, so you can also open any lab directly).

# %% tags=["parameters"]
TARGET = "local"          # local | kind-cpu | kind-gpu (kind: deploy first, see docs/kind.md)
TOPOLOGY = "quickstart"   # labs/topologies/<name>.yaml: 4 simulated replicas, 1,400 KV blocks each

# %% [markdown]
# ## 1. The environment
# `kvlab.notebook` holds the plumbing the labs share (finding the run directory, starting a gateway,
# running a phase); everything it does is also a `kvlab` command you can run in a terminal.

# %%
import sys
import time

import plotly.graph_objects as go
import requests

from kvlab import notebook as nb
from kvlab.telemetry import names as n

runs = nb.setup()
env = nb.run_env()
for key, value in env.items():
    print(f"{key:<11} {value or '— not installed (optional)'}")
assert sys.version_info >= (3, 11), "kvlab needs Python 3.11 or newer"

# %% [markdown]
# Only Python is required for `local`. With `prometheus` installed the stack also scrapes metrics
# (lab 03 reads them); with `jaeger` installed, traces go to a Jaeger UI instead of files. The kind
# targets need `docker`, `kind` and a deployed cluster (`kvlab cluster create && kvlab cluster deploy`).

# %% [markdown]
# ## 2. Start the stack
# Locally this is `kvlab up --topology quickstart`: a detached supervisor starts 4 simulated vLLM
# replicas (`kvlab engine sim`), the KV-aware gateway (`kvlab gateway --policy kv-aware`), an OTLP
# trace sink and Prometheus, and writes where everything is to `runs/<id>/stack.json`.

# %%
started = time.monotonic()
stack = nb.ensure_stack(TARGET, TOPOLOGY)
print(f"stack {stack.id} ready in {time.monotonic() - started:.1f} s — run dir {stack.run_dir}")
print(f"gateway     {stack.gateway}  (policy {stack.policy})")
for r in stack.replicas:
    print(f"replica     {r.name:<8} {r.url}  KV events {r.kv_events}")
print(f"traces      {stack.traces_dir or stack.jaeger or stack.otlp_endpoint or 'off'}")
print(f"prometheus  {stack.prometheus or 'off'}")

# %% [markdown]
# ## 3. Health
# Every replica speaks vLLM's API (`/health`, `/v1/models`, `/metrics`, ...). The gateway's
# `/debug/endpoints` shows what it knows about each replica: health, load, and whether its KV-event
# stream (the feed of the block index) is connected.

# %%
health = {"gateway": requests.get(f"{stack.gateway}/health", timeout=5).status_code}
for r in stack.replicas:
    health[r.name] = requests.get(f"{r.url}/health", timeout=5).status_code
print(health)
models = requests.get(f"{stack.gateway}/v1/models", timeout=5).json()
print("served model:", [m["id"] for m in models["data"]])
if TARGET == "local":
    endpoints = requests.get(f"{stack.gateway}/debug/endpoints", timeout=5).json()
    for e in endpoints["replicas"]:
        print(f"{e['name']:<8} healthy={e['healthy']}  load={e['load']}  kv-events={e['events']['state']}")

# %% [markdown]
# ## 4. The same prompt, twice
# A long system prompt (~1,000 tokens) and a question. The first request computes every prompt
# token (a cache *miss*). The second one is routed by the KV-aware gateway to the replica that
# now holds that prefix, and the engine reuses it: `cached_tokens` in the usage block, and a much
# shorter time to first token. The gateway's response headers say what it saw:
# `x-kvlab-prefix-available` (cached on *any* replica) and `x-kvlab-prefix-predicted` (on the chosen one).

# %%
system = " ".join(f"rule {i}: answer briefly and cite the handbook section." for i in range(45))
body = {"model": stack.model, "max_tokens": 8, "stream": False,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": "What is the return policy?"}]}
calls = []
for attempt in ("first (cold)", "second (same prefix)"):
    t0 = time.perf_counter()
    resp = requests.post(f"{stack.gateway}/v1/chat/completions", json=body, timeout=60)
    resp.raise_for_status()
    usage = resp.json()["usage"]
    calls.append({"call": attempt, "ms": (time.perf_counter() - t0) * 1000,
                  "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
                  "replica": resp.headers.get(n.HEADER_ROUTED_TO),
                  "available": resp.headers.get(n.HEADER_PREFIX_AVAILABLE),
                  "predicted": resp.headers.get(n.HEADER_PREFIX_PREDICTED)})
for c in calls:
    print(c)

# %%
fig = go.Figure([
    go.Bar(name="computed prompt tokens", x=[c["call"] for c in calls], y=[c["prompt"] - c["cached"] for c in calls],
           marker_color="#d62728"),
    go.Bar(name="cached prompt tokens (reused KV)", x=[c["call"] for c in calls], y=[c["cached"] for c in calls],
           marker_color="#2ca02c"),
])
fig.update_layout(barmode="stack", title="Prompt tokens the engine had to compute vs reuse", template="plotly_white",
                  height=360, yaxis_title="tokens")
for c in calls:
    fig.add_annotation(x=c["call"], y=c["prompt"], text=f"{c['ms']:.0f} ms on {c['replica']}", showarrow=False, yshift=12)
fig.show()

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - every part of the stack answers its health check
# - the first request is mostly a cache miss; the second reuses the cached prefix
# - locally, the repeat went to the replica holding the prefix
#
# If one fails, read the troubleshooting section below.

# %%
assert all(code == 200 for code in health.values()), f"something is unhealthy: {health}"
if TARGET == "local":
    assert len(stack.replicas) >= 2, "the lab needs at least two replicas"
first, second = calls
assert first["cached"] < first["prompt"] // 2, "the first request should be (mostly) a cache miss"
assert second["cached"] >= second["prompt"] // 2, "the second request should reuse the cached prefix"
if TARGET == "local":
    assert second["replica"] == first["replica"], "kv-aware routing should pick the replica holding the prefix"
print("✓ checkpoints passed: stack healthy, the repeated prefix was routed to its cache and reused")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | `kvlab up failed` | the message ends with the supervisor log; per-process logs are in `runs/<id>/logs/`. A port clash is impossible (ports are chosen free), a crash of `kvlab engine sim` is not: read `engine-replicas.log`. |
# | a replica `unhealthy` | `kvlab status` shows processes and health; `kvlab down` then re-run this notebook. |
# | `kv-events=connecting` for long | the gateway cannot reach the replicas' ZMQ sockets; it still routes (approximate index), but check the gateway log. |
# | second request not cached | another stack or user sent traffic in between and evicted it (1,400 blocks per replica); re-run the cell. |
# | kind: `cluster must be deployed` / connection refused | `kvlab cluster status`; NodePorts 30080/30081 must be published (docs/kind.md). |
#
# The stack keeps running for the next labs. Stop it with `kvlab down` (or `nb.stop_stack()`).
