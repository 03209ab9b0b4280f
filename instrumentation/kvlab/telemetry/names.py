"""Span names, attribute keys and metric names shared by every kvlab process.

GenAI semantic-convention keys where they exist, `kvlab.` for the rest. docs/tracing.md lists
each one with its meaning; add new names here, never as string literals at the call site.
"""

# ---- span names -------------------------------------------------------------------------
# Where kvlab's span is the same step as one of llm-d's or vLLM's, it has their name and place in
# the tree (llm-d/llm-d-router and vllm-project/vllm; docs/tracing.md has the table with each
# source file, tests/data/upstream_span_names.json the names and the commits they were read at).
# llm-d-router pkg/epp/handlers/server.go: the ext_proc stream's SERVER span (`kvlab epp`)
SPAN_EPP_REQUEST = "gateway.request"
# llm-d-router pkg/epp/requestcontrol/director.go: SERVER, one per request (kvlab gateway's root)
SPAN_GATEWAY_REQUEST = "gateway.request_orchestration"
# llm-d-router pkg/epp/scheduling/scheduler.go and scheduler_profile.go: one profile's run, with
# filter -> scoring (one child per scorer, named by its type) -> picker; kvlab.schedule.* on it
SPAN_SCHEDULE = "run_scheduler_profile"
SPAN_FILTER = "filter_endpoints"
SPAN_SCORING = "llm_d.epp.scoring"
SPAN_SCORER_PREFIX = "llm_d.epp.scorer."                # + the scorer's type (its registered name)
SPAN_PICK = "pick_endpoints"
# llm-d-router pkg/kvcache/kvblock/traced_index.go: the KV-block index lookup
SPAN_INDEX_LOOKUP = "index_lookup"
# llm-d-router pkg/epp/framework/plugins/scheduling/profilehandler/disagg/: P/D or not, and the
# prefill endpoint handed to the proxy; kvlab.pd.* on the first
SPAN_PD_DECISION = "pick_disagg_profile"
SPAN_PD_PREPARE = "prepare_disaggregation"
# llm-d-router pkg/sidecar/proxy/connector_*.go: the P/D proxy's two legs (CLIENT in kvlab, whose
# gateway is its own P/D proxy)
SPAN_PREFILL_CALL = "llm_d.pd_proxy.prefill"
SPAN_DECODE_CALL = "llm_d.pd_proxy.decode"
UPSTREAM_NAMED_CALLS = frozenset({SPAN_PREFILL_CALL, SPAN_DECODE_CALL})   # calls named by llm-d, not GenAI
LLMD_SPANS = frozenset({SPAN_EPP_REQUEST, SPAN_GATEWAY_REQUEST, SPAN_SCHEDULE, SPAN_FILTER, SPAN_SCORING, SPAN_PICK,
                        SPAN_INDEX_LOOKUP, SPAN_PD_DECISION, SPAN_PD_PREPARE, SPAN_PREFILL_CALL, SPAN_DECODE_CALL})
# vllm-project/vllm vllm/v1/engine/output_processor.py: SERVER, one per request on a replica (the
# simulator's, as real vLLM's); engine.queue/prefill/decode/kv_transfer/moe_dispatch are kvlab's
SPAN_ENGINE_REQUEST = "llm_request"
VLLM_SPANS = frozenset({SPAN_ENGINE_REQUEST})
# kvlab's own spans
SPAN_UPSTREAM = "gateway.upstream"              # CLIENT, propagates context to the replica
SPAN_ENGINE_QUEUE = "engine.queue"
SPAN_ENGINE_PREFILL = "engine.prefill"
SPAN_ENGINE_DECODE = "engine.decode"
SPAN_ENGINE_KV_TRANSFER = "engine.kv_transfer"
SPAN_ENGINE_MOE_DISPATCH = "engine.moe_dispatch"
SPAN_PULL_DECISION = "gateway.pull_decision"     # holder vs pull vs recompute (docs/tiered.md)
SPAN_CLIENT_REQUEST = "client.request"          # CLIENT, the Locust user's root span
SPAN_SCALE_ACTION = "stack.scale"
SPAN_STACK_RESTART = "stack.restart"                      # the supervisor restarted a dead child
SPAN_AUTOSCALE = "gateway.autoscale"            # the desired-replica recommendation changed
SPAN_TOKENIZER_PROBE = "gateway.tokenizer_probe"  # tokenizer parity with a new replica (gateway/parity.py)

# kvlab's GenAI client spans (client.request, gateway.upstream) are named
# `{gen_ai.operation.name} {gen_ai.request.model}` as the conventions say, their SPAN_* role kept in
# SPAN_ROLE for readers (kvlab.traces matches either). Spans with an llm-d or vLLM name keep it.
SPAN_ROLE = "kvlab.span.role"

# Traces written before issue 46: the role (attribute) or name a span had then -> its name now.
# kvlab.traces.span reads old traces through these, so every reader sees the new names.
RENAMED_ROLES = {"gateway.request": SPAN_GATEWAY_REQUEST, "engine.request": SPAN_ENGINE_REQUEST,
                 "gateway.prefill_call": SPAN_PREFILL_CALL, "gateway.decode_call": SPAN_DECODE_CALL}
RENAMED_SPANS = {"gateway.schedule": SPAN_SCHEDULE, "gateway.pd_decision": SPAN_PD_DECISION,
                 "epp.request": SPAN_EPP_REQUEST}


def genai_span_name(operation: str, model: object = None) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, or the operation alone without a model."""
    return f"{operation} {model}" if isinstance(model, str) and model else operation


# ---- GenAI semantic conventions ---------------------------------------------------------
# open-telemetry/semantic-conventions-genai, docs/gen-ai/gen-ai-spans.md (inference span), as of
# commit 9430220 (the GenAI conventions moved there after semantic-conventions v1.41)
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"          # "chat" | "text_completion"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"            # required; kvlab's engines are vLLM (real or simulated)
GEN_AI_PROVIDER_VLLM = "vllm"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
# = the engine's usage.prompt_tokens_details.cached_tokens
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"     # seconds (double), streaming only
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
ERROR_TYPE = "error.type"

# ---- llm-d's attributes (llm-d/llm-d-router; docs/tracing.md) -----------------------------
# pkg/epp/scheduling/scheduler.go, scheduler_profile.go
LLMD_PROFILE_NAME = "llm_d.epp.scheduling.profile.name"
PROFILE_DEFAULT = "default"                                       # kvlab's one profile without P/D
PROFILE_DECODE = "decode"                                         # with P/D: the decode pool
PROFILE_PREFILL = "prefill"                                       # a P/D split's prefill pool
LLMD_FILTER_CANDIDATES = "llm_d.epp.filter.candidate_endpoints"
LLMD_FILTER_FILTERED = "llm_d.epp.filter.filtered_endpoints"      # endpoints left after the filters
LLMD_SCORER_COUNT = "llm_d.epp.scorer.count"
LLMD_SCORING_CANDIDATES = "llm_d.epp.scoring.candidate_endpoints"
LLMD_SCORER_TYPE = "llm_d.epp.scorer.type"
LLMD_SCORER_NAME = "llm_d.epp.scorer.name"
LLMD_SCORER_WEIGHT = "llm_d.epp.scorer.weight"
LLMD_SCORER_CANDIDATES = "llm_d.epp.scorer.candidate_endpoints"
LLMD_SCORER_SCORE_MAX = "llm_d.epp.scorer.score.max"
LLMD_SCORER_SCORE_AVG = "llm_d.epp.scorer.score.avg"
LLMD_SCORER_ENDPOINTS_SCORED = "llm_d.epp.scorer.endpoints_scored"
LLMD_PICKER_CANDIDATES = "llm_d.epp.picker.candidate_endpoints"
LLMD_PICKER_TOP_ENDPOINTS = "llm_d.epp.picker.top_endpoints"      # string[] best first
LLMD_PICKER_TOP_SCORES = "llm_d.epp.picker.top_scores"            # double[] their weighted scores
LLMD_PICKER_TOP_N = 3                                             # maxTracedEndpointScores upstream
# pkg/kvcache/kvblock/traced_index.go
LLMD_INDEX_LOOKUP_BLOCKS = "llm_d.kv_cache.index.lookup.block_count"
LLMD_LOOKUP_POD_FILTER = "llm_d.kv_cache.lookup.pod_filter_count"
LLMD_LOOKUP_CACHE_HIT = "llm_d.kv_cache.lookup.cache_hit"
LLMD_LOOKUP_BLOCKS_FOUND = "llm_d.kv_cache.lookup.blocks_found"
# pkg/epp/framework/plugins/scheduling/profilehandler/disagg/disagg_profile_handler.go
LLMD_PD_USED = "llm_d.epp.pd.disaggregation_used"
# pkg/sidecar/proxy/connector_nixlv2.go (the sequential prefill-then-decode connector)
LLMD_PD_PREFILL_TARGET = "llm_d.pd_proxy.prefill_target"
LLMD_PD_PREFILL_STATUS = "llm_d.pd_proxy.prefill.status_code"
LLMD_PD_PREFILL_DURATION = "llm_d.pd_proxy.prefill.duration_ms"   # on the prefill span
LLMD_PD_DECODE_TARGET = "llm_d.pd_proxy.decode.target"
LLMD_PD_DECODE_DURATION = "llm_d.pd_proxy.decode.duration_ms"     # on the decode span
LLMD_PD_TOTAL_MS = "llm_d.pd_proxy.total_duration_ms"             # the decode span: request start -> end
LLMD_PD_TRUE_TTFT_MS = "llm_d.pd_proxy.true_ttft_ms"              # request start -> decode start
LLMD_PD_PREFILL_MS = "llm_d.pd_proxy.prefill_duration_ms"
LLMD_PD_DECODE_MS = "llm_d.pd_proxy.decode_duration_ms"
LLMD_PD_COORDINATOR_MS = "llm_d.pd_proxy.coordinator_overhead_ms"  # prefill end -> decode start

# ---- kvlab attributes -------------------------------------------------------------------
REPLICA = "kvlab.replica"                         # replica name, e.g. "sim-0"
ENDPOINT = "kvlab.endpoint"                       # replica URL
POLICY = "kvlab.policy"
PROMPT_TOKENS = "kvlab.prompt_tokens"
BLOCK_SIZE = "kvlab.block_size"
PREFIX_AVAILABLE_TOKENS = "kvlab.prefix.available_tokens"   # best cached prefix on any replica
PREFIX_PREDICTED_TOKENS = "kvlab.prefix.predicted_tokens"   # cached prefix on the chosen replica
# delivered: the cached_tokens the replica reported (before issue 21: kvlab.prefix.delivered_tokens)
PREFIX_DELIVERED_TOKENS = GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS
PREFIX_SPECULATIVE_TOKENS = "kvlab.prefix.speculative_tokens"  # part of predicted not yet confirmed by KV events
SCHEDULE_CHOSEN = "kvlab.schedule.chosen"
SCHEDULE_REASON = "kvlab.schedule.reason"
SCHEDULE_WEIGHTS = "kvlab.schedule.weights"                 # JSON {scorer: weight}
SCHEDULE_CANDIDATES = "kvlab.schedule.candidates"           # JSON [{replica, scores, total, prefix_tokens}]
SCHEDULE_SHADOW = "kvlab.schedule.shadow"                   # true when scores were computed but not used
SCHEDULE_ATTEMPT = "kvlab.schedule.attempt"
SCHEDULE_SHADOW_CHOICE = "kvlab.schedule.shadow_choice"     # what max-score would have chosen
SCHEDULE_FILTERED = "kvlab.schedule.filtered"               # JSON [replica] dropped by thresholds
SCHEDULE_INDEX = "kvlab.schedule.index"                     # JSON {replica: precise|approximate}
# JSON [{kind, start, end, priority}] sent (docs/semantic-kv.md)
RETENTION_DIRECTIVES = "kvlab.retention.directives"
# JSON {class: blocks} of the chosen replica's cached prefix
RETENTION_PREFIX_CLASSES = "kvlab.retention.prefix_classes"
SCHEDULE_KEYS_MS = "kvlab.schedule.keys_ms"                 # block hashing time
TOKENIZE_MS = "kvlab.tokenize.ms"
UPSTREAM_ERROR = "kvlab.upstream.error"                     # connect|status|stream|timeout
# a generation resumed on another replica after its stream broke (span event on the request span)
EVENT_RESUME = "gateway.resume"
RESUME_REASON = "kvlab.resume.reason"                       # stream|timeout|error_event|ended|body
RESUME_FROM = "kvlab.resume.from_replica"
RESUME_TOKENS_SENT = "kvlab.resume.tokens_sent"             # completion tokens the client had already
RESUME_INDEX = "kvlab.resume.index"
RESUME_COUNT = "kvlab.resume.count"                         # on the request span: resumes it took
RESUME_PREFILL_TOKENS = "kvlab.resume.prefill_tokens"       # the resumed call's prompt its replica computed
TOKENIZE_CACHED = "kvlab.tokenize.cache_hit_tokens"
TOKENIZE_SOURCE = "kvlab.tokenize.source"                   # local (the gateway's tokenizer) | engine (tokens-in)
TOKENIZER_STATE = "kvlab.tokenizer.state"                   # match | tokenizer-mismatch | unverified
EVENT_TOKENIZER_MISMATCH = "kvlab.tokenizer.mismatch"       # span event of the parity probe
TOKENIZER_SAMPLE = "kvlab.tokenizer.sample"                 # completion | chat
TOKENIZER_FIRST_DIFFERENCE = "kvlab.tokenizer.first_difference"  # token position
TOKENIZER_LOCAL_ID = "kvlab.tokenizer.gateway_id"
TOKENIZER_REPLICA_ID = "kvlab.tokenizer.replica_id"
ENGINE_QUEUE_MS = "kvlab.engine.queue_ms"
ENGINE_CACHED_TOKENS = "kvlab.engine.cached_tokens"
ENGINE_COMPUTED_TOKENS = "kvlab.engine.computed_tokens"
ENGINE_BATCH_SIZE = "kvlab.engine.batch_size"
ENGINE_DP_RANK = "kvlab.engine.dp_rank"
PD_DECISION = "kvlab.pd.decision"                 # "split" | "unified"
PD_REASON = "kvlab.pd.reason"
PD_UNCACHED_TOKENS = "kvlab.pd.uncached_tokens"
PD_THRESHOLD = "kvlab.pd.threshold_tokens"
PD_PREFILL_REPLICA = "kvlab.pd.prefill_replica"
PD_DECODE_REPLICA = "kvlab.pd.decode_replica"
PD_ROLE = "kvlab.pd.role"                          # engine.request: "prefill" | "decode" side of a split
PD_PREFILL_CANDIDATES = "kvlab.pd.prefill_candidates"   # JSON [{replica, prefix_tokens, inflight}]
PD_FALLBACK = "kvlab.pd.fallback"                  # true when a failed prefill fell back to unified
EVENT_PD_FALLBACK = "pd.fallback_unified"          # span event: the prefill call failed, serving unified
KV_TRANSFER_LOCAL_TOKENS = "kvlab.kv_transfer.local_tokens"      # already cached on the decode replica
KV_TRANSFER_OFFERED_TOKENS = "kvlab.kv_transfer.offered_tokens"  # full-block tokens the prefill offered
KV_TRANSFER_SKIPPED = "kvlab.kv_transfer.skipped"                # why nothing was pulled
KV_TRANSFER_TOKENS = "kvlab.kv_transfer.tokens"
KV_TRANSFER_MS = "kvlab.kv_transfer.ms"
MOE_EXPERTS_HIT = "kvlab.moe.experts_hit"
MOE_TOKENS_PER_EP_RANK = "kvlab.moe.tokens_per_ep_rank"
MOE_IMBALANCE = "kvlab.moe.imbalance"
MOE_WAIT_MS = "kvlab.moe.wait_slowest_ms"
DP_RANK = "kvlab.dp.rank"
# wide-EP / data parallel / autoscaling (issue 9, docs/wide-ep.md, docs/autoscaling.md)
MOE_EXPERTS_TOTAL = "kvlab.moe.experts"                  # E, routed experts per layer
MOE_TOP_K = "kvlab.moe.top_k"
MOE_STEPS = "kvlab.moe.steps"                            # engine steps the request took part in
DP_WAIT_MS = "kvlab.dp.wait_busiest_ms"                  # time its rank idled for the busiest DP rank
DP_REPLICA = "kvlab.dp.replica"                          # the replica the chosen rank belongs to
DP_REASON = "kvlab.dp.rank_reason"                       # why this rank and not its siblings
DP_SIBLINGS = "kvlab.dp.siblings"                        # JSON [{rank, prefix_tokens, waiting, inflight_tokens}]
EVENT_AUTOSCALE = "kvlab.autoscale.recommendation"       # span event when the recommendation changes
AUTOSCALE_DESIRED = "kvlab.autoscale.desired_replicas"
AUTOSCALE_CURRENT = "kvlab.autoscale.current_replicas"
AUTOSCALE_REASON = "kvlab.autoscale.reason"
AUTOSCALE_QUEUE = "kvlab.autoscale.waiting_per_replica"
AUTOSCALE_KV = "kvlab.autoscale.kv_usage"
SCALE_DIRECTION = "kvlab.scale.direction"                # up | down
SCALE_FROM = "kvlab.scale.from_replicas"
SCALE_TO = "kvlab.scale.to_replicas"
SCALE_REPLICA = "kvlab.scale.replica"                    # the replica started or stopped
STACK_CHILD = "kvlab.stack.child"                        # the restarted child (engine-<pool>, gateway, ...)
STACK_EXIT_CODE = "kvlab.stack.exit_code"                # how the dead child ended
STACK_RESTARTS = "kvlab.stack.restarts"                  # restarts of that child so far
SCALE_READY_MS = "kvlab.scale.ready_ms"                  # start -> listening (up) / drain time (down)
WORKLOAD = "kvlab.workload"
# tiered KV (issue 22, docs/tiered.md)
ENGINE_CPU_HIT_TOKENS = "kvlab.engine.cpu_hit_tokens"    # of the cached tokens, loaded from the CPU tier
ENGINE_KV_LOAD_MS = "kvlab.engine.kv_load_ms"            # modelled CPU -> GPU load time of those blocks
PREFIX_TIERS = "kvlab.prefix.tiers"                      # JSON [{replica, gpu_tokens, cpu_tokens}] of the candidates
PREFIX_CPU_TOKENS = "kvlab.prefix.cpu_tokens"            # of the chosen replica's prefix, held only in its CPU tier
PULL_CHOICE = "kvlab.pull.choice"                        # holder | pull | recompute (gateway/pull.py)
PULL_HOLDER = "kvlab.pull.holder"                        # the replica holding the longest prefix
PULL_TARGET = "kvlab.pull.target"                        # the replica the scheduler chose
PULL_HOLDER_TOKENS = "kvlab.pull.holder_prefix_tokens"   # the holder's prefix (what a pull brings the target to)
PULL_COSTS = "kvlab.pull.costs_ms"                       # JSON {holder, pull, recompute}: estimated TTFT, ms
# chunked decoding (issue 23, docs/chunked-decoding.md): one gateway.chunk span per chunk
SPAN_CHUNK = "gateway.chunk"                             # CLIENT, one upstream call per chunk
CHUNK_INDEX = "kvlab.chunk.index"                        # 0 for the first chunk
CHUNK_SIZE = "kvlab.chunk.size_tokens"                   # max_tokens of this chunk
CHUNK_WAIT_MS = "kvlab.chunk.wait_ms"                    # time queued for a slot before this chunk
CHUNK_HOLD_REASON = "kvlab.chunk.hold_reason"            # none | slots-busy | yield-to-higher | reserved
CHUNK_PRIORITY = "kvlab.chunk.priority"                  # the request's class: high | normal | low
CHUNK_TENANT = "kvlab.chunk.tenant"
CHUNK_CACHED_TOKENS = "kvlab.chunk.cached_tokens"        # the replica's cached_tokens for this chunk
CHUNK_RESUME_HIT = "kvlab.chunk.resume_hit"              # resumed chunk: prompt + generated-so-far was cached
CHUNK_GENERATED_TOKENS = "kvlab.chunk.generated_tokens"  # tokens this chunk generated
CHUNK_COUNT = "kvlab.chunk.count"                        # gateway.request: chunks the request took

# ---- response headers --------------------------------------------------------------------
HEADER_REPLICA = "x-kvlab-replica"        # set by a replica: its name
HEADER_ROUTED_TO = "x-kvlab-routed-to"    # set by the gateway: the replica it chose
HEADER_REQUEST_ID = "x-request-id"
HEADER_KV_TRANSFER_TOKENS = "x-kvlab-kv-transfer-tokens"  # set by a decode replica: tokens of KV pulled
HEADER_KV_TRANSFER_MS = "x-kvlab-kv-transfer-ms"          # set by a decode replica: time of the pull
HEADER_PD_DECISION = "x-kvlab-pd-decision"                # set by the gateway: split | unified
HEADER_PREFILLED_BY = "x-kvlab-prefilled-by"              # set by the gateway: the prefill replica of a split
HEADER_POLICY = "x-kvlab-policy"                    # set by the gateway: the policy in force
HEADER_PROMPT_TOKENS = "x-kvlab-prompt-tokens"      # prompt tokens as the gateway counted them
HEADER_PREFIX_AVAILABLE = "x-kvlab-prefix-available"  # tokens: best cached prefix on any replica
HEADER_PREFIX_PREDICTED = "x-kvlab-prefix-predicted"  # tokens: cached prefix on the chosen replica
HEADER_PREFIX_DELIVERED = "x-kvlab-prefix-delivered"  # tokens: cached_tokens (non-streaming only)
HEADER_PREFIX_SPECULATIVE = "x-kvlab-prefix-speculative"  # tokens: part of predicted that was speculative
# set by the gateway: HOLDER;TOKENS, pull that prefix from HOLDER (docs/tiered.md)
HEADER_KV_PULL = "x-kvlab-kv-pull"
HEADER_PRIORITY = "x-kvlab-priority"                # request: high | normal | low (chunked decoding)
HEADER_TENANT = "x-kvlab-tenant"                    # request: the tenant chunk fairness is shared between
HEADER_CHUNK_TOKENS = "x-kvlab-chunk-tokens"        # request: chunk size for this request (0: off)
# request headers (experimental, docs/semantic-kv.md)
HEADER_RETENTION = "x-kvlab-retention"          # JSON retention directives, as the body's retention_directives
HEADER_KV_HINT = "x-kvlab-kv-hint"              # a client's hint to the gateway: branch (its new tail evicts first)

# ---- vLLM metric names (kept by the simulator, read by the gateway) ----------------------
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"   # counter; exposed with _total
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"         # counter; exposed with _total
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
# vLLM's `llm_request` span's attributes (vllm/tracing/utils.py SpanAttributes, set in
# vllm/v1/engine/output_processor.py do_tracing), real vLLM's and the simulator's; seconds
VLLM_LATENCY_TTFT = "gen_ai.latency.time_to_first_token"     # API server's receipt -> first token
VLLM_LATENCY_QUEUE = "gen_ai.latency.time_in_queue"           # engine core: queued -> scheduled
VLLM_LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"  # engine core: scheduled -> first token
VLLM_LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"    # first token -> last token
VLLM_LATENCY_INFERENCE = "gen_ai.latency.time_in_model_inference"  # scheduled -> last token
VLLM_LATENCY_E2E = "gen_ai.latency.e2e"                        # arrival -> finished
VLLM_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
VLLM_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
VLLM_REQUEST_ID = "gen_ai.request.id"
VLLM_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
VLLM_REQUEST_TOP_P = "gen_ai.request.top_p"
VLLM_REQUEST_N = "gen_ai.request.n"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_QUEUE_TIME = "vllm:request_queue_time_seconds"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"                 # counter
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"         # counter
VLLM_REQUEST_SUCCESS = "vllm:request_success"             # counter
VLLM_NUM_PREEMPTIONS = "vllm:num_preemptions"             # counter
VLLM_EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"   # counter: KV-connector lookups (tokens)
VLLM_EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"         # counter: found in the connector (CPU tier)
# the simulator's typed retention (experimental, docs/semantic-kv.md), label retention_class
KVLAB_SIM_KV_BLOCKS = "kvlab:kv_cache_blocks"                       # gauge {retention_class}: cached blocks
KVLAB_SIM_PINNED_USAGE = "kvlab:kv_cache_pinned_perc"               # gauge: pinned blocks / all blocks
KVLAB_SIM_EVICTIONS = "kvlab:kv_cache_evictions"                    # counter {retention_class}
KVLAB_SIM_PINS_REFUSED = "kvlab:kv_cache_pins_refused"              # counter: pins over the bound (kept as high)
KVLAB_SIM_BLOCK_QUERIES = "kvlab:prefix_cache_block_queries"        # counter {retention_class}: prompt blocks looked up
KVLAB_SIM_BLOCK_HITS = "kvlab:prefix_cache_block_hits"              # counter {retention_class}: of which cached

# ---- kvlab gateway metrics ----------------------------------------------------------------
KVLAB_REQUESTS = "kvlab_gateway_requests"                 # counter {replica, policy, status}
KVLAB_DECISIONS = "kvlab_gateway_decisions"               # counter {policy, reason}
# counter {policy, kind=available|predicted|speculative|delivered|prompt}
KVLAB_PREFIX_TOKENS = "kvlab_gateway_prefix_tokens"
KVLAB_ROUTING_SECONDS = "kvlab_gateway_routing_seconds"   # histogram {policy}
KVLAB_GATEWAY_TTFT = "kvlab_gateway_ttft_seconds"         # histogram {policy, replica}
KVLAB_UPSTREAM_ERRORS = "kvlab_gateway_upstream_errors"   # counter {replica, kind}
KVLAB_RETRIES = "kvlab_gateway_retries"                   # counter {replica}
KVLAB_RESUMES = "kvlab_gateway_resumes"                   # counter {reason}: generations resumed elsewhere
KVLAB_EJECTIONS = "kvlab_gateway_ejections"               # counter {replica}
KVLAB_PD_DECISIONS = "kvlab_gateway_pd_decisions"         # counter {decision, reason}
KVLAB_KV_TRANSFER_SECONDS = "kvlab_gateway_kv_transfer_seconds"   # histogram
KVLAB_DESIRED_REPLICAS = "kvlab_gateway_desired_replicas"  # gauge
KVLAB_CURRENT_REPLICAS = "kvlab_gateway_current_replicas"  # gauge: the replicas the recommendation counted
KVLAB_INFLIGHT = "kvlab_gateway_inflight"                 # gauge {replica}
KVLAB_ENDPOINT_HEALTHY = "kvlab_gateway_endpoint_healthy"  # gauge {replica} 1|0
KVLAB_INDEX_BLOCKS = "kvlab_gateway_index_blocks"         # gauge {replica, index=precise|approximate}
KVLAB_KV_EVENTS = "kvlab_gateway_kv_events"               # counter {replica} event batches ingested
KVLAB_KV_EVENT_GAPS = "kvlab_gateway_kv_event_gaps"       # counter {replica, kind=gap|restart}
KVLAB_KV_EVENTS_STATE = "kvlab_gateway_kv_events_state"   # gauge {replica, state=none|connecting|live|stale} 1|0
KVLAB_TOKENIZE_SECONDS = "kvlab_gateway_tokenize_seconds"  # histogram
KVLAB_CHUNKS = "kvlab_gateway_chunks"                     # counter {priority}: chunked-decode upstream calls
KVLAB_CHUNK_HOLDS = "kvlab_gateway_chunk_holds"           # counter {priority, reason}: chunks that waited for a slot
KVLAB_CHUNK_RESUMES = "kvlab_gateway_chunk_resumes"       # counter {outcome=hit|miss}: resumed chunks' prefix reuse
KVLAB_CHUNK_QUEUE_SECONDS = "kvlab_gateway_chunk_queue_seconds"  # histogram {priority}: wait for a slot per chunk
# old name -> current name: still exposed (same values) for one release, then removed (docs/observability.md)
KVLAB_DEPRECATED_ALIASES = {"kvlab_kv_transfer_seconds": KVLAB_KV_TRANSFER_SECONDS}
KVLAB_TOKENIZER_PARITY = "kvlab_gateway_tokenizer_parity"  # gauge {replica} 1 match, 0 mismatch (absent: unverified)
