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
# # Lab 05 · Prefill/decode disaggregation: split or unified?
#
# **Objectives**
# 1. Run a stack with a **prefill** pool and a **decode** pool (2 + 2 simulated replicas).
# 2. Send three requests and see the gateway's three answers: a short prompt stays **unified**, a long
#    uncached prompt is **split** (prefill on one replica, KV transferred, decode on another), the
#    same long prompt again stays unified because the decode replica now **has it cached**.
# 3. Read a split in its trace: the decision with its inputs, the prefill call, the KV transfer, the decode.
# 4. Compare unified KV-aware serving with P/D on a mixed workload — and see when splitting does
#    *not* pay.
#
# Reference: docs/pd.md.
#
# **Time:** about 50 s (two 15 s phases).
# **Stack:** starts `pd` (4 replicas: 2 prefill + 2 decode), stopping the `quickstart` stack of
# labs 00–04; leaves it running.

# %% tags=["parameters"]
TARGET = "local"             # local only for now: kind renders the pd topology, this lab is untested there
TOPOLOGY = "pd"              # labs/topologies/pd.yaml: 2 prefill + 2 decode replicas
WORKLOAD = "pd-mix"          # 30 % long fresh prompts, 70 % behind one of 4 shared system prompts
USERS = 8
DURATION_S = 15.0
SEED = 0

# %%
import os
from collections import defaultdict

import numpy as np
import plotly.graph_objects as go
import requests
from rich.console import Console

from kvlab import notebook as nb
from kvlab.load.table import summary_table
from kvlab.report import figures
from kvlab.report.pd import worst_gap_cdf
from kvlab.telemetry import names as n
from kvlab.traces.figures import waterfall_figure

nb.setup()
console = Console(width=110)
stack = nb.ensure_stack(TARGET, TOPOLOGY)       # stops another topology's stack first
for r in stack.replicas:
    print(f"{r.name:<10} role {r.role:<8} {r.url}")
print(f"gateway {stack.gateway} policy {stack.policy} (P/D on: the topology has prefill replicas)")

# %% [markdown]
# ## 1. Three requests, three decisions
# The gateway first picks the **decode** replica (KV-aware, among `decode`/`both` replicas), then
# computes `uncached = prompt − prefix cached on it`. It splits when `uncached ≥ threshold_tokens`
# (256 by default), otherwise serves the request whole. Response headers say what it did
# (`x-kvlab-pd-decision`, `x-kvlab-prefilled-by`); after a split `cached_tokens` counts the KV the
# decode replica pulled, as vLLM does (it did not compute those tokens). Each request carries our own `traceparent`, so we know its trace id.

# %%
def ask(system, question, max_tokens=16):
    trace_id = os.urandom(16).hex()
    body = {"model": stack.model, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    resp = requests.post(f"{stack.gateway}/v1/chat/completions", json=body, timeout=120,
                         headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
    resp.raise_for_status()
    h = resp.headers
    return {"trace_id": trace_id, "decision": h.get(n.HEADER_PD_DECISION), "decode": h.get(n.HEADER_ROUTED_TO),
            "prefill": h.get(n.HEADER_PREFILLED_BY), "prompt": int(h.get(n.HEADER_PROMPT_TOKENS, 0)),
            "cached": resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]}


tag = os.urandom(3).hex()
long_doc = f"[{tag}] " + " ".join(f"clause {i}: the supplier shall deliver the goods as agreed." for i in range(90))
probes = {
    "short prompt": ask("You are terse.", "Hi?"),
    "long, uncached": ask(long_doc, "Summarise the contract."),
    "long, again": ask(long_doc, "Summarise the contract."),
}
for name, p in probes.items():
    print(f"{name:<15} prompt {p['prompt']:>5} → {p['decision']:<8} decode on {p['decode']}, "
          f"prefill on {p['prefill'] or '–'}, cached_tokens {p['cached']}")

# %% [markdown]
# The reasons are on llm-d's `pick_disagg_profile` span (kvlab's `kvlab.pd.*` additions) (spans arrive within a few seconds):

# %%
traces = {name: nb.wait_trace(stack, p["trace_id"], spans=(n.SPAN_PD_DECISION,)) for name, p in probes.items()}
decisions = {}
for name, t in traces.items():
    span = t.first(n.SPAN_PD_DECISION)
    decisions[name] = {k.split(".")[-1]: span.attr(k) for k in
                       (n.PD_DECISION, n.PD_REASON, n.PD_UNCACHED_TOKENS, n.PD_THRESHOLD, n.PD_DECODE_REPLICA,
                        n.PD_PREFILL_REPLICA)}
    print(f"{name:<15}", decisions[name])

# %% [markdown]
# ## 2. A split, span by span
# llm-d's names: `pick_disagg_profile` (with the prefill pool's `run_scheduler_profile` under it),
# `prepare_disaggregation`, then the P/D proxy's `llm_d.pd_proxy.prefill` → the prefill replica's
# vLLM `llm_request` (`kvlab.pd.role=prefill`, one output token), then `llm_d.pd_proxy.decode` → the
# decode replica's `llm_request` with kvlab's `engine.kv_transfer` (tokens pulled, from which
# replica) before its short prefill (only the last partial block) and decode. The decode leg carries
# llm-d's `llm_d.pd_proxy.true_ttft_ms`: the request's start to the decode call's, the routing,
# prefill and coordination that the engines' own metrics miss. One trace id across three services.

# %%
# both replicas' llm_request spans: each process exports on its own schedule
split_trace = nb.wait_trace(stack, probes["long, uncached"]["trace_id"],
                            spans=(n.SPAN_PREFILL_CALL, n.SPAN_DECODE_CALL, n.SPAN_ENGINE_KV_TRANSFER,
                                   n.SPAN_ENGINE_REQUEST, n.SPAN_ENGINE_REQUEST))
waterfall_figure(split_trace).show()
decode_leg = split_trace.first(n.SPAN_DECODE_CALL)
print({k.rsplit(".", 1)[-1]: decode_leg.attr(k) for k in (n.LLMD_PD_TRUE_TTFT_MS, n.LLMD_PD_PREFILL_MS,
                                                          n.LLMD_PD_DECODE_MS, n.LLMD_PD_COORDINATOR_MS)})
transfer = split_trace.first(n.SPAN_ENGINE_KV_TRANSFER)
print({k.split(".")[-1]: transfer.attr(k) for k in (n.KV_TRANSFER_TOKENS, n.KV_TRANSFER_LOCAL_TOKENS,
                                                   n.KV_TRANSFER_OFFERED_TOKENS, n.KV_TRANSFER_MS)})

# %% [markdown]
# ## 3. Unified vs P/D on a mixed workload
# Same four replicas, same seeded `pd-mix` stream. Phase 1 uses the policy `kv-aware-unified`
# (P/D off: the prefill replicas serve whole requests too); phase 2 the stack's `kv-aware` (P/D on).

# %%
settings = dict(workload=WORKLOAD, users=USERS, duration_s=DURATION_S, seed=SEED)
unified = nb.run_phase(stack, "kv-aware-unified", **settings)
split = nb.run_phase(stack, "kv-aware", **settings)
phases = {"kv-aware-unified": unified, "kv-aware (P/D)": split}
records = {p: v.records for p, v in phases.items()}
console.print(summary_table({p: v.summary for p, v in phases.items()}, title="unified → P/D"))

# %% [markdown]
# Latency by prompt kind and decision: long fresh prompts (`group == "long"`) are the ones P/D
# splits; shared-prefix prompts are cached on their decode replica and stay unified.

# %%
rows = defaultdict(list)
for phase, recs in records.items():
    for r in recs:
        if r.error or r.ttft_ms is None:
            continue
        kind = "long uncached" if r.group == "long" else "shared prefix"
        rows[(phase, kind, r.pd or "off")].append(r)
print(f"{'phase':<18} {'prompts':<14} {'P/D':<9} {'n':>4} {'TTFT p50':>9} {'TTFT p95':>9} {'worst gap p95':>14}")
for (phase, kind, decision), rs in sorted(rows.items()):
    ttft = [r.ttft_ms for r in rs]
    gap = [r.itl_max_ms for r in rs if r.itl_max_ms is not None]
    print(f"{phase:<18} {kind:<14} {decision:<9} {len(rs):>4} {np.percentile(ttft, 50):>9.0f} "
          f"{np.percentile(ttft, 95):>9.0f} {np.percentile(gap, 95) if gap else float('nan'):>14.0f}")

fig = go.Figure()
for i, (phase, recs) in enumerate(records.items()):
    for kind in ("long uncached", "shared prefix"):
        ys = [r.ttft_ms for r in recs if not r.error and r.ttft_ms is not None
              and (r.group == "long") == (kind == "long uncached")]
        fig.add_trace(go.Box(y=ys, x=[kind] * len(ys), name=phase, marker_color=figures.COLORS[i],
                             boxpoints=False, legendgroup=phase, showlegend=kind == "long uncached"))
fig.update_layout(boxmode="group", title="TTFT by prompt kind: unified vs P/D", yaxis_type="log",
                  yaxis_title="TTFT (ms, log)", template="plotly_white", height=380)
fig.show()
worst_gap_cdf(records).show()

# %% [markdown]
# Every decision of the run, from the `pick_disagg_profile` spans: the rule is
# `split ⇔ uncached ≥ threshold` (and the prompt itself not shorter than the threshold). A
# shared-prefix request is split when its decode replica did not hold the prefix yet — the first
# of its group there, or when load sent it to the other decode replica.

# %%
from pathlib import Path

from kvlab.traces.sources import open_source

by_reason = defaultdict(int)
broken = []
for t in open_source(run_dir=Path(stack.run_dir), jaeger=stack.jaeger).traces():
    span = t.first(n.SPAN_PD_DECISION)
    if span is None:
        continue
    decision, reason = span.attr(n.PD_DECISION), span.attr(n.PD_REASON)
    by_reason[(decision, reason)] += 1
    uncached, threshold = int(span.attr(n.PD_UNCACHED_TOKENS) or 0), int(span.attr(n.PD_THRESHOLD) or 0)
    expect_split = uncached >= threshold and reason not in ("short-prompt", "no-prefill-replica")
    if decision in ("split", "unified") and (decision == "split") != expect_split:
        broken.append((t.trace_id, decision, reason, uncached, threshold))
for (decision, reason), count in sorted(by_reason.items()):
    print(f"{decision:<9} {reason:<26} {count:>5}")

# %% [markdown]
# **Reading it.** The decisions are the intended ones, but on this laptop profile P/D does not pay:
# a split adds a second call, a KV transfer and the prefill pool's queue to the long prompts' TTFT,
# and what it buys — decode steps no longer stalled by a co-batched 1,500-token prefill (the worst
# inter-token gap) — is small when decode batches are small. P/D helps when prefill capacity matches
# the long-prompt load and decode interference is what hurts: GPU profiles, where a transfer costs
# ~8 % of a recompute and decode batches are large. Try `threshold_tokens`, or a 1 prefill + 3 decode
# topology, and watch the prefill pool become the bottleneck (docs/benchmarks.md, "Prefill/decode").

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - a short prompt stays unified (`short-prompt`), a long uncached one splits, the long one again stays
#   unified (`cached-on-decode`)
# - one trace holds both sides of the split, and the decode replica pulled KV
# - ≥ 90 % of long fresh prompts split, ≥ 60 % of cached ones unified; every `gateway.pd_decision` obeys
#   split ⇔ uncached ≥ threshold; no errors

# %%
assert decisions["short prompt"]["decision"] == "unified" and decisions["short prompt"]["reason"] == "short-prompt"
assert decisions["long, uncached"]["decision"] == "split", f"a long uncached prompt should split: {decisions['long, uncached']}"
assert decisions["long, again"]["decision"] == "unified" and decisions["long, again"]["reason"] == "cached-on-decode"
roles = {s.attr(n.PD_ROLE) for s in split_trace.find(n.SPAN_ENGINE_REQUEST)}
assert {"prefill", "decode"} <= roles, f"one trace should hold both sides of the split: {roles}"
assert int(transfer.attr(n.KV_TRANSFER_TOKENS) or 0) > 0, "the decode replica should have pulled KV"
longs = [r for r in records["kv-aware (P/D)"] if r.group == "long" and not r.error]
shared = [r for r in records["kv-aware (P/D)"] if r.group != "long" and not r.error]
assert longs and sum(r.pd == "split" for r in longs) >= 0.9 * len(longs), "long fresh prompts should be split"
assert sum(r.pd == "unified" for r in shared) >= 0.6 * len(shared), "cached prompts should mostly stay unified"
assert not broken, f"decisions that break the rule split ⇔ uncached ≥ threshold: {broken[:5]}"
assert all(v.summary.errors == 0 for v in phases.values()), "both phases should complete cleanly"
print(f"✓ split {len(longs)} long prompts, kept {sum(r.pd == 'unified' for r in shared)} cached ones unified")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | every decision `unified`, no `pick_disagg_profile` span | the topology has no `prefill` pool, or `pd.enabled: false` in the policy (`kv-aware-unified`). |
# | `fallback` decisions | the prefill call failed (span event `pd.fallback_unified` says why): read the prefill replica's log in `runs/<id>/logs/`. |
# | the long probe `unified` with `cached-on-decode` | its prefix was already cached (re-running the cell without a new tag): run the cell again, it draws a new tag. |
# | real vLLM: every split falls back | vLLM needs a KV connector on both pools (`--kv-transfer-config`, docs/pd.md). |
