"""The scheduler: filters -> weighted scorers -> picker. `base` holds the pipeline and the plug-in
interfaces, `registry` the plug-ins by name, one module per plug-in (imported here, in the order
their scores are listed on the schedule span)."""

from kvlab.gateway.scheduler import (  # noqa: F401, I001  (registers the plug-ins, in this order)
    thresholds,
    prefix,
    queue,
    kv_usage,
    inflight,
    inflight_tokens,
    pending_prefill,
    predicted_ttft,
    max_score,
    round_robin,
    random_choice,
    rank_blind,
    cache_aware,
    prefix_cache,
    precise_prefix_cache,
    kv_utilization,
    waiting_queue,
    epp_pickers,
)
