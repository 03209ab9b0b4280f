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
# # Lab 11 · Failures: a replica dies, no request is lost
#
# **Objectives**
# 1. **Kill a replica under streaming load** (SIGKILL, no goodbye) and count the requests that
#    failed: none. The streams it was serving are **resumed** on the other replica from the text the
#    client already had (docs/reliability.md, "A replica dies mid-generation").
# 2. See what the resumed requests paid: their **TTFT or token gap spikes**, everyone else's not.
# 3. Read the **trace of a resume**: which replica was lost, after how many tokens, who continued and
#    how much prompt it had to prefill again.
# 4. Watch `kvlab up`'s **supervisor restart** the replica on its port with an empty cache, the gateway
#    route to it again and its **hit rate warm up**.
# 5. Two faults the tests measure, shown: a **dropped KV-event stream** (with and without vLLM's replay
#    endpoint) and a **trace backend that is down** or black-holes (requests do not notice).
#
# The same story from the command line: `kvlab lab --topology faults` (labs/topologies/faults.yaml).
# **Time:** 80–110 s on 2 cores (the stack's start; one phase that runs until the restarted replica
# has served a while; section 5 starts one more gateway).
# **Stack:** starts `faults` (2 replicas, a and b), stopping lab 10's last stack; leaves it running.

# %% tags=["parameters"]
TARGET = "local"             # local only: the supervisor restarting the replica is `kvlab up`'s
TOPOLOGY = "faults"          # labs/topologies/faults.yaml: replicas a and b, one process each
USERS = 8
DURATION_S = 8.0             # the phase's least length; it goes on until AFTER_RESTART requests after the restart
LIMIT_S = 150.0              # ... for at most this long (a busy machine restarts b slowly)
AFTER_REQUESTS = 16          # b is killed once the gateway has answered this many
AFTER_RESTART = 30           # b needs a few requests of groups it has seen again to hit its cache
SEED = 0
TRACE_REQUESTS = 30          # section 5: requests per trace-backend setting

# %%
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import plotly.graph_objects as go
import requests
from plotly.subplots import make_subplots
from rich.console import Console
from rich.table import Table

from kvlab import notebook as nb
from kvlab.report import figures
from kvlab.scenarios import faults
from kvlab.scenarios import outage as ot
from kvlab.telemetry import names as n
from kvlab.traces import explain
from kvlab.traces.figures import waterfall_figure

nb.setup()
console = Console(width=110)
stack = nb.ensure_stack(TARGET, TOPOLOGY)       # stops another topology's stack first
run = Path(stack.run_dir)
settings, workload = stack.topology.faults, stack.topology.workload
for r in stack.replicas:
    print(f"{r.name:<4} {r.url}")
print(f"gateway {stack.gateway} policy {stack.policy}; supervisor pid {stack.supervisor.pid}")

# %% [markdown]
# ## 1. Kill replica b under load
# Eight users send streaming chat requests (`shared-prefix`, 64-token answers) through the kv-aware
# gateway. Once it has answered `AFTER_REQUESTS`, `ot.Outage` sends SIGKILL to b's process group (on
# real vLLM that is the API server and its engine core). What happens next is the gateway's doing:
#
# - a stream b was serving breaks (connection reset): the gateway sends the same request to a, with
#   the text the client already received as the assistant message to continue and the remaining
#   `max_tokens`; the client sees one stream (one id, one finish reason, usage that adds up);
# - requests b had not started, and new ones, are routed to a (a refused connection is retried, b is
#   ejected and its blocks leave the index);
# - the supervisor starts b again on the same port; one good scrape re-admits it.
#
# The phase runs until b has been back for `AFTER_RESTART` requests.

# %%
victim = ot.pool_replica(run, settings.kill)
watch = ot.Outage(stack.gateway, victim, lambda: ot.recorded_pid(run, settings.kill),
                  after_requests=AFTER_REQUESTS, after_restart=AFTER_RESTART)
with watch:
    loss = nb.run_phase(stack, stack.policy, workload=workload.name, params=workload.params, users=USERS,
                        duration_s=DURATION_S, seed=SEED, until=watch.done, limit_s=LIMIT_S)
result = watch.save(loss.dir, loss.records)      # also phase-N-kv-aware/outage.json
table = Table(title=f"replica {victim.name} SIGKILLed under load")
for c in ("requests", "failed", "in flight on b at the kill", "resumes (by reason)", "b down (s)",
          "served by b after its restart"):
    table.add_column(c, justify="right")
table.add_row(str(result["requests"]), str(result["failed"]), str(result["in_flight_at_kill"]),
              f"{result['resumes']} {result['resumes_by_reason']}", str(result["down_s"]),
              str(result["after_restart_on_replica"]))
console.print(table)

# %% [markdown]
# ## 2. What a resume costs the request
# Every request of the phase by when it was sent, relative to the kill (dashed: b back). The resumed
# ones (in flight on b at the kill) wait for the gateway to notice, for a to prefill the prompt plus
# what was already generated — a's cache holds at most the prompt's prefix — and, with a doing b's work
# too, in a's queue. A request killed before its first token shows it as TTFT; one killed mid-stream as
# a **gap** between two tokens (the client saw the stream pause, then go on).

# %%
t_kill, t_back = watch.killed_at, watch.back_at
resumed = {id(r) for r in watch.in_flight_at_kill(loss.records)}
fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (ms)", "worst gap between two tokens (ms)"))
for i, (label, picked) in enumerate((("the others", False), ("in flight on b at the kill (resumed)", True))):
    rs = [r for r in loss.records if (id(r) in resumed) == picked and not r.error]
    for col, value in ((1, lambda r: r.ttft_ms), (2, lambda r: r.itl_max_ms)):
        fig.add_trace(go.Scatter(x=[r.ts - t_kill for r in rs], y=[value(r) for r in rs], mode="markers",
                                 name=label, showlegend=col == 1, marker=dict(color=figures.COLORS[i * 3], size=7)),
                      row=1, col=col)
for col in (1, 2):
    fig.add_vline(x=0, line_color="red", row=1, col=col)
    if t_back:
        fig.add_vline(x=t_back - t_kill, line_dash="dash", line_color="green", row=1, col=col)
fig.update_xaxes(title_text="sent at (s after the kill)")
fig.update_layout(template="plotly_white", height=360, legend=dict(orientation="h", y=-0.25))
fig.show()
print(f"p50 of max(TTFT, worst gap): resumed {result['stall_ms_p50_in_flight']} ms, "
      f"the others {result['stall_ms_p50_others']} ms")

# %% [markdown]
# ## 3. The trace of a resume
# The gateway's request span carries one `gateway.resume` event per resume: the replica lost, why
# (`stream`: the connection broke), the tokens the client already had, the replica that continued and
# the prompt it had to prefill beyond its cached prefix. Below: the first resumed request's trace,
# in words and as a waterfall (two `gateway.upstream` calls, the first cut short).
# From a terminal: `kvlab traces explain --resumed --run-dir <run dir>`.

# %%
trace = None
for r in watch.in_flight_at_kill(loss.records):
    t = nb.wait_trace(stack, r.trace_id, (n.SPAN_GATEWAY_REQUEST, n.SPAN_SCHEDULE)) if r.trace_id else None
    if t is not None and explain.resumes(t):
        trace = t
        break
assert trace is not None, "no resumed request's trace arrived"
print(f"trace {trace.trace_id}")
for line in explain.resumes(trace):
    print("  " + line)
waterfall_figure(trace).show()
print(f"kvlab traces explain --resumed --run-dir {run}")

# %% [markdown]
# ## 4. The replica comes back cold, and warms up
# The supervisor restarted b at once (`kvlab up`'s back-off: the first restart has no delay; the
# time down is b's start-up). Its cache is empty and the gateway's index forgot its blocks when it was
# ejected, so b first gets the requests a is not the better place for and prefills them; from then on
# the index learns b's blocks from its KV events and sends their groups back to it. Per replica and
# second: the delivered hit rate (cached ÷ prompt tokens) and the requests sent.

# %%
rates = ot.hit_rate_over_time(loss.records, t_kill)
fig = make_subplots(rows=1, cols=2, subplot_titles=("delivered hit rate", "requests sent per second"))
for i, (replica, points) in enumerate(rates.items()):
    fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers", name=replica,
                             line_color=figures.COLORS[i]), row=1, col=1)
    per_s: dict[float, int] = {}
    for r in loss.records:
        if r.replica == replica:
            per_s[(r.ts - t_kill) // 1] = per_s.get((r.ts - t_kill) // 1, 0) + 1
    fig.add_trace(go.Bar(x=list(per_s), y=list(per_s.values()), name=replica, showlegend=False,
                         marker_color=figures.COLORS[i], opacity=0.7), row=1, col=2)
for col in (1, 2):
    fig.add_vline(x=0, line_color="red", row=1, col=col)
    if t_back:
        fig.add_vline(x=t_back - t_kill, line_dash="dash", line_color="green", row=1, col=col)
fig.update_xaxes(title_text="s after the kill")
fig.update_yaxes(tickformat=".0%", row=1, col=1)
fig.update_layout(template="plotly_white", height=340, barmode="stack")
fig.show()
b_hits = result["hit_rate_after_restart"] or 0.0
print(f"after its restart b served {result['after_restart_on_replica']} requests, delivered hit rate {b_hits:.0%}")

# %% [markdown]
# ## 5. Two quieter faults
# **A dropped KV-event stream.** The gateway's index follows each replica's KV events over ZMQ. When
# the stream drops (the publisher unbinds, batches are published nobody hears, it binds again), the
# sequence numbers show a gap. With vLLM's replay endpoint (`replay_endpoint` in `--kv-events-config`;
# `kvlab engine vllm` and the simulator serve it) the gateway fetches exactly the lost batches and
# the replica stays `live`; without it the replica goes `stale` (its precise entries are dropped, the
# approximate index is used) and is trusted again after `kv_events_resync_s` of gap-free events
# (0.5 s here). **A trace backend that black-holes** (accepts connections, never answers: worse than
# one that is down, which refuses at once). Spans are exported in their own thread from a bounded
# queue (2,048 spans), so requests through a second gateway exporting to a black hole are as fast as
# through the stack's own, whose backend works (`TRACE_REQUESTS` each, alternating). docs/reliability.md
# measures the refused backend and traces off too (`benchmarks/faults.py`).

# %%
with ThreadPoolExecutor(1) as pool:     # asyncio.run needs a thread of its own: the kernel runs an event loop
    gaps = list(pool.map(faults.kv_event_gap, (True, False)))
table = Table(title="a KV-event stream dropped for 4 batches")
for c in ("replay endpoint", "state after the gap", "batches replayed", "blocks known after", "stale for (s)"):
    table.add_column(c, justify="right")
for g in gaps:
    table.add_row("yes" if g["replay"] else "no", g["state_after_gap"], str(g["replayed"]),
                  f"{g['blocks_after_gap']} (of {2 * g['lost_batches'] + 1}+)", str(g["stale_s"]))
console.print(table)
hole = faults.BlackHole()          # accepts connections, never answers
otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": hole.url, "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}
latency: dict[str, list[float]] = {"traces to the stack's backend": [], "traces to a black hole": []}
statuses = []
try:
    with faults.gateway(run, stack.replicas, env=otel) as (_, black_hole_url):
        for i in range(TRACE_REQUESTS):      # alternate, so both see the same machine
            for label, url in zip(latency, (stack.gateway, black_hole_url)):
                t0 = time.perf_counter()
                resp = requests.post(f"{url}/v1/completions", json={"model": stack.model, "prompt": f"trace me {i}",
                                                                   "max_tokens": 2}, timeout=30)
                latency[label].append((time.perf_counter() - t0) * 1000)
                statuses.append(resp.status_code)
finally:
    hole.close()
fig = go.Figure([go.Box(y=v, name=k, marker_color=figures.COLORS[i], boxpoints="all") for i, (k, v) in enumerate(latency.items())])
fig.update_layout(title=f"request latency (ms), {TRACE_REQUESTS} requests each", yaxis_type="log",
                  template="plotly_white", height=320)
fig.show()
p50 = {k: sorted(v)[len(v) // 2] for k, v in latency.items()}
print(f"p50 {', '.join(f'{k}: {v:.1f} ms' for k, v in p50.items())}; errors {sum(s != 200 for s in statuses)}; "
      f"connections the black hole accepted: {len(hole.requests)}")

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - b was serving at the kill; no request failed; streams were resumed, at a cost to the resumed requests
# - the trace says `resume 1: …`
# - b is restarted, routed to again, and hits its cache again
# - a KV-event gap: with replay `live`, without `stale`
# - a black-holed trace backend fails no request
#
# Directions, not values: a busy machine makes the phase slower and b's start-up longer, not the
# directions different.

# %%
assert result["in_flight_at_kill"] > 0, "b was serving nothing when it was killed: raise USERS"
assert loss.summary.errors == 0 and result["failed"] == 0, f"requests failed: {result}"
assert result["resumes"] > 0, "the broken streams should have been resumed on a"
assert result["stall_ms_max_in_flight"] > result["stall_ms_p50_others"], "a resume should cost the resumed requests time"
assert any(s.startswith("resume 1:") for s in explain.resumes(trace)), "the trace should say how it was resumed"
assert t_back is not None and result["after_restart_on_replica"] > 0, "b should be restarted and routed to again"
assert b_hits > 0, "b's cache should warm up again after its restart"
with_replay, without = gaps
assert with_replay["state_after_gap"] == "live" and with_replay["replayed"] >= with_replay["lost_batches"]
assert without["state_after_gap"] == "stale" and without["stale_s"] > 0, "without replay the replica goes stale"
assert statuses and all(s == 200 for s in statuses), "a trace backend that never answers should fail no request"
assert hole.requests, "the gateway should have tried to export its spans to the black hole"
print(f"✓ 0 of {result['requests']} requests failed; {result['resumes']} resumed; b down {result['down_s']} s, "
      f"then {result['after_restart_on_replica']} requests at {b_hits:.0%} hit rate; "
      f"KV-event gap: replayed {with_replay['replayed']} vs stale {without['stale_s']} s; trace black hole: 0 errors")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | `in flight on b at the kill` is 0 | b was idle at the kill: more `USERS`, or longer answers (`output_tokens` in the topology's workload). |
# | requests failed | read the error in `runs/<id>/phase-*/requests.jsonl`; `kvlab traces explain --resumed` shows what the gateway did. A request that asked for `n > 1`, logprobs or `echo` cannot be resumed (docs/reliability.md, the limits). |
# | b is not back (`down (s)` is None) | `runs/<id>/supervisor.log` says why it did not restart; the phase ended at `LIMIT_S`. |
# | b's hit rate stays 0 | its KV events are not reaching the gateway (`/debug/endpoints`, `events.state`), or the phase ended too soon after the restart: raise `AFTER_RESTART`. |
# | the trace did not arrive | traces are batched for ~5 s; `kvlab traces list --run-dir runs/<id>` shows what did. |
