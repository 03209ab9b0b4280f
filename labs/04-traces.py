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
# # Lab 04 · Traces: why did this request go there?
#
# **Objectives**
# 1. Open one request's trace — Locust user → gateway → replica, one trace id — as a waterfall
#    (and in Jaeger when the stack runs one), and tell llm-d's spans, vLLM's and kvlab's additions apart.
# 2. Read the gateway's routing decision: every candidate's per-scorer scores, the weights, the
#    chosen replica and how much of the prompt each one had cached ("why this replica").
# 3. Decompose the hit rate per request: **available → predicted → delivered**, for both policies.
# 4. Make the gateway choose **load over cache**, and find that decision in its trace.
#
# **Time:** about 20 s after labs 01–02; about 60 s alone (it runs two short phases first).
# **Stack:** reuses lab 00's `quickstart` stack (4 replicas) and labs 01–02's phases; starts the
# stack and runs both phases if missing. The next lab switches topology.

# %% tags=["parameters"]
TARGET = "local"             # local | kind-cpu | kind-gpu
TOPOLOGY = "quickstart"
WORKLOAD = "shared-prefix"
USERS = 8
DURATION_S = 25.0            # used only when labs 01/02 left no phases in the run directory
SEED = 0

# %%
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from rich.console import Console

from kvlab import notebook as nb
from kvlab.telemetry import names as n
from kvlab.traces.cli import decision_table, explain_lines, summary_table
from kvlab.traces.decision import decision_of
from kvlab.traces.figures import decision_figure, hitrate_figure, waterfall_figure
from kvlab.traces.hitrate import request_hits, summarize
from kvlab.traces.run import load_requests
from kvlab.traces.sources import open_source

nb.setup()
console = Console(width=110)
stack = nb.ensure_stack(TARGET, TOPOLOGY)
run_dir = Path(stack.run_dir)
settings = dict(workload=WORKLOAD, users=USERS, duration_s=DURATION_S, seed=SEED)
for policy in ("round-robin", "kv-aware"):     # the phases of labs 01 and 02, or short ones now
    nb.phase(stack, policy, **settings)

# %% [markdown]
# ## 1. Where the spans are
# Every process exports OpenTelemetry spans over OTLP. Locally they go to a small OTLP receiver
# that writes them as OTLP/JSON lines under `runs/<id>/traces/` (or to Jaeger, when a `jaeger`
# binary is installed). `kvlab traces list|show|explain` reads the same files from a terminal.
# `request_hits` joins every gateway request's decision with the client-side record of
# `requests.jsonl` (by trace id) to get the client's TTFT.

# %%
source = open_source(run_dir=run_dir, jaeger=stack.jaeger)
traces = source.traces()
rows = request_hits(traces, load_requests(run_dir))
print(f"{len(traces)} traces from {source.describe()}; {len(rows)} gateway requests")

# %% [markdown]
# ## 2. One request, end to end, as llm-d and vLLM trace it
# A kv-aware request that found its prefix cached. Its spans carry llm-d's and vLLM's names where
# they are the same step, so what you search for here is what you search for in a production
# llm-d's Jaeger or Tempo (docs/tracing.md has the table, with each name's source file):
#
# - **llm-d's** (llm-d-router): the gateway's `gateway.request_orchestration` (tokenization is on
#   it), its scheduling `run_scheduler_profile` with `index_lookup` (the KV-block index:
#   `llm_d.kv_cache.lookup.blocks_found`), `filter_endpoints`, `llm_d.epp.scoring` with one
#   `llm_d.epp.scorer.<type>` per scorer of the policy (`llm_d.epp.scorer.score.max`/`.avg`) and
#   `pick_endpoints`; under P/D (lab 04) `pick_disagg_profile`, `prepare_disaggregation` and the
#   proxy's `llm_d.pd_proxy.prefill`/`.decode` legs with `llm_d.pd_proxy.true_ttft_ms`;
# - **vLLM's**: the replica's `llm_request`, with `gen_ai.latency.time_in_queue`,
#   `time_in_model_prefill`, `time_to_first_token` ... — the simulator emits it as real vLLM does;
# - **kvlab's additions**: the Locust user's root span and the gateway's upstream call (named
#   `{operation} {model}` by the OpenTelemetry GenAI conventions), the engine's `engine.queue`,
#   `engine.prefill` (hover it: computed vs cached tokens) and `engine.decode` children, and on
#   llm-d's spans the `kvlab.*` attributes llm-d does not record: every candidate's per-scorer
#   scores, the prefix tokens available / predicted / delivered, the decision in words.
#
# One trace id, three services.

# %%
kv_rows = [r for r in rows if r.policy == "kv-aware" and r.available > 0 and r.ttft_ms is not None]
sample = kv_rows[len(kv_rows) // 2]
trace = nb.wait_trace(stack, sample.trace_id, (n.SPAN_CLIENT_REQUEST, n.SPAN_SCHEDULE, n.SPAN_ENGINE_PREFILL))
if stack.jaeger:
    print(f"open in Jaeger: {stack.jaeger}/trace/{trace.trace_id}")
else:
    print(f"trace {trace.trace_id} — in a terminal: kvlab traces show {trace.trace_id[:12]} --run-dir {run_dir}")
waterfall_figure(trace).show()
shown = (n.LLMD_SCORER_SCORE_MAX, n.LLMD_LOOKUP_BLOCKS_FOUND, n.VLLM_LATENCY_QUEUE, n.VLLM_LATENCY_PREFILL)
for depth, span in trace.walk():
    facts = ", ".join(f"{k.rsplit('.', 2)[-2]}.{k.rsplit('.', 1)[-1]}={span.attr(k):.3g}" for k in shown
                      if isinstance(span.attr(k), (int, float)))
    print(f"{'  ' * depth}{span.name:<{44 - 2 * depth}} {span.origin:<6} {span.service:<14} {facts}")

# %% [markdown]
# ## 3. Why this replica
# llm-d's scorer spans say only each scorer's best and average score. kvlab's additions on
# `run_scheduler_profile` carry every candidate as JSON: per-scorer scores (0–1), the weights, the
# weighted total and the prefix cached on each replica. The chosen one is starred.

# %%
d = decision_of(trace)
console.print(decision_table(d))
for line in explain_lines(d, sample.ttft_ms):
    console.print(line)
decision_figure(d).show()

# %% [markdown]
# Now a **round-robin** request that lost cache to routing: another replica held most of its
# prompt, but the cache-blind policy sent it elsewhere. Its scores are *shadow* scores: computed,
# recorded, ignored.

# %%
rr_lost = max((r for r in rows if r.policy == "round-robin"), key=lambda r: r.available - r.predicted)
d_rr = decision_of(source.trace(rr_lost.trace_id))
console.print(decision_table(d_rr))
decision_figure(d_rr).show()

# %% [markdown]
# ## 4. The hit-rate decomposition
# Token-weighted over every request of each policy. available − predicted is cache lost to routing;
# predicted − delivered is cache lost to eviction or a stale index. On the right, each request's
# delivered fraction against its client TTFT: hits are fast.

# %%
console.print(summary_table(rows))
hitrate_figure(rows).show()

# %% [markdown]
# ## 5. When the gateway chooses load over cache
# KV-aware does not mean "always the cache": the prefix score (×3) is the share of the prompt that
# is cached, and the load scores (queue ×1, KV usage ×0.5, in-flight ×1) can outweigh it. The
# predicted-TTFT score (×1) sits between the two: it counts the prompt tokens each replica would
# still have to prefill, times the cost per token the gateway has learned for that replica, so it
# leans towards the holder of a prefix, and by how much varies with each replica's learned cost.
# We make load win on purpose:
# 1. warm a ~400-token prefix on one replica (the *holder*);
# 2. keep the holder busy with a burst of requests of that prefix (long outputs, so they stay in flight);
# 3. meanwhile send a *probe*: the same prefix followed by a long new question (~3,300 tokens), so
#    only ~10 % of its prompt is cached. Prefix score 3 × 0.1 ≈ 0.3 no longer beats an idle
#    replica's in-flight score of 1, even with the holder's predicted-TTFT lean added.
#
# We give the probe our own W3C `traceparent`, so we know its trace id before it is sent.

# %%
def chat(content_system, content_user, max_tokens, headers=None):
    body = {"model": stack.model, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "system", "content": content_system}, {"role": "user", "content": content_user}]}
    resp = requests.post(f"{stack.gateway}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)
    resp.raise_for_status()
    return resp


tag = os.urandom(3).hex()       # a fresh prefix each run
prefix = f"[{tag}] " + " ".join(f"policy {i}: keep answers short and cite the source." for i in range(22))
holder = chat(prefix, "warm up", 1).headers[n.HEADER_ROUTED_TO]
long_question = " ".join(f"detail {i} of the customer's long and entirely new question." for i in range(135))
probe_id = os.urandom(16).hex()


def in_flight():
    """Requests the gateway has sent and not yet seen finish, over every replica (/debug/endpoints)."""
    replicas = requests.get(f"{stack.gateway}/debug/endpoints", timeout=5).json()["replicas"]
    return sum(r["load"]["inflight"] for r in replicas)


with ThreadPoolExecutor(max_workers=8) as pool:
    burst = [pool.submit(chat, prefix, f"burst question {i}", 160) for i in range(6)]
    deadline = time.monotonic() + 30     # until the gateway has the whole burst in flight (a busy machine is slow to send it)
    while in_flight() < len(burst) and not any(f.done() for f in burst) and time.monotonic() < deadline:
        time.sleep(0.05)
    probe = chat(prefix, long_question, 4, headers={"traceparent": f"00-{probe_id}-{os.urandom(8).hex()}-01"})
    burst_replicas = [f.result().headers[n.HEADER_ROUTED_TO] for f in burst]
print(f"holder {holder}; burst went to {burst_replicas}")
print(f"probe went to {probe.headers[n.HEADER_ROUTED_TO]}: prompt {probe.headers[n.HEADER_PROMPT_TOKENS]} tokens, "
      f"available {probe.headers[n.HEADER_PREFIX_AVAILABLE]}, predicted {probe.headers[n.HEADER_PREFIX_PREDICTED]}")

# %% [markdown]
# The probe's trace (spans arrive within a few seconds: exporters send in batches):

# %%
probe_trace = nb.wait_trace(stack, probe_id)
d_probe = decision_of(probe_trace)
console.print(decision_table(d_probe))
for line in explain_lines(d_probe, None):
    console.print(line)
decision_figure(d_probe).show()

# %% [markdown]
# `reason load-over-prefix`: a replica held a longer prefix (available > predicted), but its load
# scores pulled its total below an idle replica's. In production that is the trade you want when
# the holder is saturated — and the trace is where you can see it was made, and at what cost in
# recomputed tokens. How often does it happen in the load tests?

# %%
reasons = {}
for t in traces:
    dd = decision_of(t)
    if dd is not None and dd.policy == "kv-aware":
        reasons[dd.reason] = reasons.get(dd.reason, 0) + 1
print("kv-aware decisions by reason:", reasons)

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - one trace id spans client, gateway and replica, the replica's prefill span included
# - kv-aware chose the replica with the best prefix; round-robin left cache unused (shadow scores)
# - kv-aware lost at most 10 points of the available cache to routing (available − predicted),
#   round-robin at least 10 points more
# - the probe was routed for load (`load-over-prefix`), leaving the holder's cache unused

# %%
assert {"kvlab-gateway", "kvlab-locust"} <= set(trace.services) and len(trace.services) >= 3, \
    f"one trace id should span client, gateway and replica: {trace.services}"
assert trace.find(n.SPAN_ENGINE_PREFILL), "the replica's prefill span should be in the trace"
assert {"llm-d", "vLLM", "kvlab"} <= {s.origin for s in trace}, "llm-d's, vLLM's and kvlab's spans in one trace"
scorer_spans = [s for s in trace if s.name.startswith(n.SPAN_SCORER_PREFIX)]
assert len(scorer_spans) == sum(1 for w in d.weights.values() if w) and \
    all(s.attr(n.LLMD_SCORER_SCORE_MAX) is not None for s in scorer_spans), "one llm_d.epp.scorer.<type> per weighted scorer"
assert isinstance(trace.attr(n.VLLM_LATENCY_QUEUE, [n.SPAN_ENGINE_REQUEST]), float), "vLLM's llm_request latencies"
assert d.chosen == sample.replica and d.predicted == d.available, "kv-aware chose the replica with the best prefix"
assert d_rr.shadow and d_rr.available > d_rr.predicted, "round-robin ignored a cached prefix (shadow scores)"
stats = summarize(rows)
# the cache lost to routing, not the hit rate: a short phase on a busy machine has few warm requests
lost = {p: stats[p]["available"] - stats[p]["predicted"] for p in ("round-robin", "kv-aware")}
assert lost["kv-aware"] <= 0.1 and lost["round-robin"] >= lost["kv-aware"] + 0.1, \
    f"kv-aware should lose little cache to routing, round-robin more: {lost}"
assert d_probe.reason == "load-over-prefix", f"the probe should be routed for load, got reason {d_probe.reason}"
assert d_probe.chosen != holder and d_probe.available > d_probe.predicted, "the probe left the holder's cache unused"
print("✓ traced one request end to end, read two routing decisions and found load chosen over cache")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | `0 traces` | the topology's `observability.traces` is `off`, or the sink died: `runs/<id>/logs/sink.log` (or `jaeger.log`). |
# | a trace without the client span | Locust's spans are flushed when it exits; requests still in flight then are cut. Pick another request. |
# | `did not arrive ... within 20 s` | the gateway or replica cannot reach the OTLP endpoint in `stack.json`; check their logs for exporter errors. |
# | probe reason `prefix` | the burst finished before the probe was scheduled (a very fast machine) or the holder took no load: raise the burst's `max_tokens` or its size. Or the holder's learned prefill cost was far below the others' (the decision table's `predicted_ttft` row): run section 5 again. |
# | Jaeger link 404 | Jaeger keeps traces in memory: a restarted Jaeger has forgotten them. |
