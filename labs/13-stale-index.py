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
# # Lab 13 · A stale index: llm-d's approximate and precise schedulers on a stepped ramp
#
# **Objectives**
# 1. Run llm-d's two scheduler configs as upstream wrote them (EndpointPickerConfig files,
#    kvlab/assets/epp/): GIE's approximate `prefix-cache-scorer`, which learns only from its own
#    routing, and llm-d's precise scorer, fed by the engines' KV events.
# 2. Step the load up as inference-perf does (a warm-up, then stages of rising rate) and find the
#    stage where the approximate index starts to claim prefixes the servers no longer hold.
# 3. Read one such decision: the prefix the scheduler predicted against the one the engine delivered.
#
# The approximate scorer's LRU holds 31,250 hashes a server (GIE's default, ~500 k tokens) against
# servers that hold 12,800 tokens each here: it cannot see evictions, so it outlives the cache it
# guesses (GIE's prefix-aware guide). Every figure is from the cluster twin, not a live run.
#
# **Time:** about 30 s.
# **Stack:** none: the twin runs in this kernel.

# %% tags=["parameters"]
TARGET = "local"             # the twin runs in this process: no stack
REPLICAS = 4
NUM_BLOCKS = 200             # KV blocks of 64 tokens a replica: 12,800 tokens
GROUPS = 32                  # shared prefixes; 4 prompts each, ~73 k tokens of working set
WARMUP = (4, 10)             # requests/s, seconds
STAGES = [4, 8, 16, 24, 32]  # requests/s, STAGE_S each
STAGE_S = 10
SEED = 0

# %%
import plotly.graph_objects as go

from kvlab import notebook as nb
from kvlab.load.stages import Stage
from kvlab.twin.runner import plans, run
from kvlab.twin.settings import TwinSettings

nb.setup()
POLICIES = ["llm-d-approximate", "llm-d-precise"]
settings = TwinSettings(workload="shared-prefix", replicas=REPLICAS, profile="h100-qwen3-32b-tp2", block_size=64,
                        num_blocks=NUM_BLOCKS, max_model_len=4096, seed=SEED,   # a request must fit the small cache
                        workload_params={"groups": GROUPS, "prompts_per_group": 4, "system_tokens": 1500,
                                         "question_tokens": 200, "output_tokens": 16},
                        stages=[Stage(rate=WARMUP[0], duration=WARMUP[1], warmup=True)]
                        + [Stage(rate=r, duration=STAGE_S) for r in STAGES])
results = {plan.policy.name: run(plan, oracle=False) for plan in plans(settings, POLICIES)}
for name, r in results.items():
    print(name)
    for st in r.summary.stages:
        print(f"  {st.rate:>4g} req/s{' (warm-up)' if st.warmup else '':<10} TTFT p90 {st.ttft_p90_s:6.2f} s · "
              f"delivered hit rate {st.hit_rate:.2f} · predicted but not delivered {st.false_hit_rate:.2f} · "
              f"KV usage p90 {st.kv_usage_p90:.2f}")

# %% [markdown]
# ## Per stage: false hits and TTFT
# "Predicted but not delivered" is, per stage, the prompt tokens the scheduler believed cached on the
# replica it chose, minus those the engine reported cached, over all prompt tokens.

# %%
fig = go.Figure()
for name, r in results.items():
    rows = [st for st in r.summary.stages if not st.warmup]
    fig.add_bar(x=[f"{st.rate:g}" for st in rows], y=[st.false_hit_rate for st in rows], name=name)
fig.update_layout(title="Predicted but not delivered, per stage (twin)", xaxis={"title": "requests/s"},
                  yaxis={"title": "share of prompt tokens", "tickformat": ".0%"}, barmode="group")
fig.show()
fig = go.Figure([go.Scatter(x=[f"{st.rate:g}" for st in r.summary.stages if not st.warmup],
                            y=[st.ttft_p90_s for st in r.summary.stages if not st.warmup], name=name,
                            mode="lines+markers") for name, r in results.items()])
fig.update_layout(title="TTFT p90 per stage (twin)", xaxis={"title": "requests/s"}, yaxis={"title": "s"})
fig.show()

# %% [markdown]
# ## One stale decision
# The first request after the warm-up whose chosen replica had lost most of what the approximate index
# predicted for it, and the same prompt's fate under the precise scheduler.

# %%
approx, precise = results["llm-d-approximate"], results["llm-d-precise"]
stale = next(r for r in approx.records
             if r.ts >= WARMUP[1] and (r.predicted_tokens or 0) - (r.cached_tokens or 0) >= 512)
twin = next(r for r in precise.records if (r.group, r.session, r.step) == (stale.group, stale.session, stale.step))
first_stage = next(st for st in approx.summary.stages if not st.warmup and st.false_hit_rate > 0.05)
for name, rec in (("approximate", stale), ("precise", twin)):
    print(f"{name:<12} t={rec.ts:5.1f} s → {rec.replica}: predicted {rec.predicted_tokens:,} of "
          f"{rec.prompt_tokens:,} prompt tokens, delivered {rec.cached_tokens:,} "
          f"(predicted − delivered {(rec.predicted_tokens or 0) - (rec.cached_tokens or 0):,}), "
          f"TTFT {rec.ttft_ms:,.0f} ms")
print(f"false hits pass 5 % of prompt tokens at the {first_stage.rate:g} req/s stage")

# %% [markdown]
# The approximate scorer sent the prompt where it had sent its group before; that replica has since
# evicted the prefix to make room for other groups, and nothing told the scorer. The precise scorer
# reads BlockRemoved events, so its prediction matches what the engine delivers.

# %% [markdown]
# ## Checkpoints
# The cells below assert:
# - the approximate index claims prefixes the servers evicted: false hits > 20 % of prompt tokens at the top stage
# - the precise index stays under 10 % false hits at every stage
# - precise delivers more hits than approximate over the ramp
# - the stale decision predicted ≥ 512 tokens more than the engine delivered; the precise one delivered what it predicted

# %%
ramp = [st for st in approx.summary.stages if not st.warmup]
exact = [st for st in precise.summary.stages if not st.warmup]
assert ramp[-1].false_hit_rate > 0.2, "the approximate index did not go stale"
assert all(st.false_hit_rate < 0.1 for st in exact), "the precise index claimed prefixes the engines lacked"
assert sum(st.hit_rate for st in exact) > sum(st.hit_rate for st in ramp), "precise did not deliver more hits"
assert stale.predicted_tokens - stale.cached_tokens >= 512 and twin.cached_tokens >= twin.predicted_tokens - 64
print("✓ the approximate index outlives the cache it guesses; the precise one does not")

# %% [markdown]
# ## Troubleshooting
# | symptom | what to do |
# |---|---|
# | no stale decision found | the cache holds the working set: lower `NUM_BLOCKS` or raise `GROUPS`. |
# | every TTFT in seconds | the top stage is over the replicas' capacity: lower the last `STAGES`. |
# | slow | shorten `STAGE_S`; the twin's speed is in docs/benchmarks.md. |
