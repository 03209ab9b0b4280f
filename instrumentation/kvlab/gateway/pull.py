"""Cross-replica KV reuse: route to the prefix holder, pull its KV to another replica, or recompute.

When the replica holding the longest prefix of a prompt is busy, the scheduler's choice may be
another replica that would recompute that prefix. A third option is to send the request there with
a *pull* hint (`x-kvlab-kv-pull: HOLDER;TOKENS`): the replica fetches the prefix's KV from the
holder over the link between them (the simulator prices it like its P/D pull, engine/sim/transfer.py)
instead of recomputing it. llm-d pulls KV peer-to-peer this way (NIXL). The decision compares three
estimated TTFTs, each the work queued ahead of the request plus its own:

    holder     = queue(holder) + (prompt - prefix(holder)) x c
    pull       = queue(target) + link_ms_fixed + (prefix(holder) - prefix(target)) x link_ms_per_token
                 + (prompt - prefix(holder)) x c
    recompute  = queue(target) + (prompt - prefix(target)) x c

`queue(r)` is the replica's pending prefill tokens (gateway/prefill.py) times `c`, its learned cost
per prefill token (or `prefill_ms_per_token` until one is learned). The cheapest wins; a pull is only
considered for at least `min_tokens` more prefix than the target holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.config import Strict
from kvlab.gateway.endpoints import Backend


class PullSettings(Strict, frozen=True):
    """Cross-replica pull (docs/tiered.md). Off unless `enabled`; link costs as the simulator's
    cpu-tiny profile prices its P/D pull (kv_transfer_ms_fixed / _per_token)."""

    enabled: bool = False
    min_tokens: int = 256                 # a pull must bring at least this many more prefix tokens
    link_ms_fixed: float = 2.0            # per pull: handshake, notification
    link_ms_per_token: float = 0.02       # KV bytes per token / link bandwidth
    prefill_ms_per_token: float = 0.635   # until the gateway has learned a replica's own (cpu-tiny's)


@dataclass(frozen=True, slots=True)
class PullDecision:
    choice: str            # holder | pull | recompute
    holder: str
    target: str
    holder_prefix: int     # the hint's TOKENS: the target ends up with this prefix (pulling what it lacks)
    costs: dict[str, float]  # estimated TTFT in ms per option


def _c(r: Backend, s: PullSettings) -> float:
    return r.prefill_ms_per_token or s.prefill_ms_per_token


def decide(prompt_tokens: int, holder: Backend, holder_prefix: int, target: Backend, target_prefix: int,
           s: PullSettings) -> PullDecision | None:
    """The cheapest of holder / pull / recompute for a prompt whose best prefix is on `holder` while
    the scheduler chose `target`; None when there is nothing to decide (same replica, or the holder's
    extra prefix is below `min_tokens`)."""
    gain = holder_prefix - target_prefix
    if holder.name == target.name or gain < s.min_tokens:
        return None
    ch, ct = _c(holder, s), _c(target, s)
    q_holder = holder.pending_prefill_tokens * ch
    q_target = target.pending_prefill_tokens * ct
    costs = {
        "holder": q_holder + (prompt_tokens - holder_prefix) * ch,
        "pull": q_target + s.link_ms_fixed + gain * s.link_ms_per_token + (prompt_tokens - holder_prefix) * ct,
        "recompute": q_target + (prompt_tokens - target_prefix) * ct,
    }
    choice = min(costs, key=lambda k: costs[k])
    return PullDecision(choice, holder.name, target.name, holder_prefix, costs)


def hint(d: PullDecision) -> str:
    """The `x-kvlab-kv-pull` value of a pull decision: HOLDER;TOKENS."""
    return f"{d.holder};{d.holder_prefix}"

