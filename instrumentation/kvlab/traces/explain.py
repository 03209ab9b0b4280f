"""A routing decision in words: who won, over whom, and which weighted scorer decided it; for a
cache-blind policy, what kv-aware would have picked from the same per-replica inputs.

The winner's margin over the runner-up is the sum over scorers of weight × (winner's score −
runner-up's score), so each term says how much one signal pushed the choice one way or the other.
The counterfactual re-runs the gateway's own scheduler (`kvlab.gateway.scheduler`) with the
kv-aware preset on the inputs the schedule span recorded for each replica (cached prefix, queue,
running, KV usage, in-flight requests and tokens, pending prefill, learned prefill cost).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvlab.telemetry import names
from kvlab.traces.decision import Candidate, Decision
from kvlab.traces.span import Trace

# the raw per-replica inputs the schedule span records next to the scores
LOAD_COLUMNS = (("waiting", "queue"), ("running", "running"), ("inflight", "in-flight"),
                ("kv_usage", "KV use"))
_INPUTS = ("waiting", "running", "kv_usage", "inflight", "inflight_tokens", "pending_prefill_tokens")


@dataclass(frozen=True)
class Contribution:
    scorer: str
    weight: float
    delta: float        # weight × (winner's score − runner-up's score): > 0 pushed toward the winner


def runner_up(d: Decision) -> Candidate | None:
    """The highest-total candidate other than the chosen one (filtered-out replicas excluded)."""
    others = [c for c in d.candidates if not c.chosen and not c.extra.get("filtered") and c.total is not None]
    return max(others, key=lambda c: c.total or 0.0, default=None)


def winner(d: Decision) -> Candidate | None:
    return next((c for c in d.candidates if c.chosen), None)


def contributions(d: Decision, win: Candidate, other: Candidate) -> list[Contribution]:
    """Per weighted scorer, its share of the margin of `win` over `other`, largest effect first."""
    out = [Contribution(s, w, w * (win.scores.get(s, 0.0) - other.scores.get(s, 0.0)))
           for s, w in d.weights.items() if w]
    return sorted(out, key=lambda c: -abs(c.delta))


def visible_scorers(d: Decision, all_scorers: bool = False) -> list[str]:
    """Scorers worth a column: those with a non-zero weight, or every one with `all_scorers`."""
    return d.scorers if all_scorers else [s for s in d.scorers if d.weights.get(s)]


def _num(c: Candidate, key: str) -> float:
    value = c.extra.get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def phrase(scorer: str, win: Candidate, other: Candidate) -> str:
    """What the scorer saw, in words and raw numbers, from the winner's side."""
    def compare(key: str, fewer: str, more: str, unit: str, pct: bool = False) -> str:
        a, b = _num(win, key), _num(other, key)
        word = fewer if a < b else more if a > b else f"equal {unit}"
        fa, fb = (f"{a:.0%}", f"{b:.0%}") if pct else (f"{a:g}", f"{b:g}")
        return f"{word} ({fa} vs {fb})" if a != b else word

    if scorer == "prefix":
        a, b = win.prefix_tokens or 0, other.prefix_tokens or 0
        if a == b:
            return f"an equal cached prefix ({a} tokens)"
        return f"a {abs(a - b)}-token {'longer' if a > b else 'shorter'} cached prefix ({a} vs {b})"
    if scorer == "queue":
        return compare("waiting", "fewer queued requests", "more queued requests", "queues")
    if scorer == "inflight":
        return compare("inflight", "fewer in-flight requests", "more in-flight requests", "in-flight requests")
    if scorer == "kv_usage":
        return compare("kv_usage", "lower KV-cache usage", "higher KV-cache usage", "KV usage", pct=True)
    if scorer == "inflight_tokens":
        return compare("inflight_tokens", "fewer in-flight prefill tokens", "more in-flight prefill tokens",
                       "in-flight tokens")
    if scorer == "pending_prefill":
        return compare("pending_prefill_tokens", "less pending prefill", "more pending prefill", "pending prefill")
    if scorer == "predicted_ttft":
        better = win.scores.get(scorer, 0.0) >= other.scores.get(scorer, 0.0)
        return f"a {'lower' if better else 'higher'} predicted TTFT"
    return scorer


def _signed(x: float) -> str:
    return f"{'+' if x >= 0 else '−'}{abs(x):.2f}"


def margin_sentence(d: Decision) -> str:
    """"sim-3 won by 0.26 over sim-1: +0.33 from fewer in-flight requests (1 vs 3) against −0.08
    for a 48-token shorter cached prefix (48 vs 96)" — every weighted scorer that moved the margin,
    each term a column of the decision's table (weight × score difference); the terms add up to the
    margin, and whatever the totals hold beyond them is named as the rest."""
    win, other = winner(d), runner_up(d)
    if win is None:
        return "no candidate was chosen"
    if other is None:
        return f"{win.replica} was the only candidate"
    margin = (win.total or 0.0) - (other.total or 0.0)
    parts = [c for c in contributions(d, win, other) if abs(c.delta) >= 0.005]
    pro = [c for c in parts if c.delta > 0]
    con = [c for c in parts if c.delta < 0]
    rest = margin - sum(c.delta for c in parts)
    if not pro and margin < 0.005:
        return f"{win.replica} tied with {other.replica} at {win.total or 0.0:.2f} (no scorer separated them)"
    text = f"{win.replica} won by {margin:.2f} over {other.replica}: " + ", ".join(
        f"{_signed(c.delta)} from {phrase(c.scorer, win, other)}" for c in pro)
    if con:
        text += (" against " if pro else "") + ", ".join(
            f"{_signed(c.delta)} for {phrase(c.scorer, win, other)}" for c in con)
    if abs(rest) >= 0.005:
        text += f", {_signed(rest)} from the rest of the totals (terms under 0.005 each, or no scorer's)"
    return text


def deciding_scorer(d: Decision) -> str | None:
    """The scorer with the largest share of the winner's margin (None without a runner-up)."""
    win, other = winner(d), runner_up(d)
    if win is None or other is None:
        return None
    parts = contributions(d, win, other)
    return parts[0].scorer if parts and parts[0].delta > 0 else None


def counterfactual(d: Decision, policy: str = "kv-aware",
                   weights: dict[str, float] | None = None) -> Decision | None:
    """The decision `policy` (its preset; `weights` instead of the preset's, e.g. the ones the
    run's own kv-aware decisions recorded) would have made on the inputs recorded in `d`. None
    when the span lacks the per-replica load inputs, as spans from before they were recorded do."""
    if not d.candidates or any(k not in c.extra for c in d.candidates for k in _INPUTS):
        return None
    from kvlab.contract import Endpoint
    from kvlab.gateway.config import load_policy
    from kvlab.gateway.endpoints import Backend
    from kvlab.gateway.scheduler import presets
    from kvlab.gateway.scheduler.base import RouteRequest

    def replica(c: Candidate) -> Backend:
        cost = c.extra.get("prefill_ms_per_token")
        return Backend(Endpoint(name=c.replica, url=""), waiting=_num(c, "waiting"), running=_num(c, "running"),
                       kv_usage=_num(c, "kv_usage"), inflight=int(_num(c, "inflight")),
                       inflight_tokens=int(_num(c, "inflight_tokens")),
                       pending_prefill_tokens=int(_num(c, "pending_prefill_tokens")),
                       prefill_ms_per_token=float(cost) if isinstance(cost, int | float) else None)

    cfg = load_policy(policy)
    if weights:
        known = {k: v for k, v in weights.items() if k in cfg.weights.__struct_fields__}
        cfg = msgspec.structs.replace(cfg, weights=msgspec.structs.replace(cfg.weights, **known))
    scheduler = presets.build(cfg)
    prefix = {c.replica: c.prefix_tokens or 0 for c in d.candidates}
    spec = {c.replica: int(_num(c, "speculative_tokens")) for c in d.candidates}
    g = scheduler.schedule(RouteRequest(d.prompt_tokens or 0), [replica(c) for c in d.candidates], prefix, spec)
    cands = [Candidate(replica=c.name, scores=dict(c.scores), total=c.total, prefix_tokens=c.prefix_tokens,
                       chosen=c.name == g.chosen.name,
                       extra={**next(x.extra for x in d.candidates if x.replica == c.name),
                              "filtered": c.name in g.filtered})
             for c in g.candidates]
    return Decision(trace_id=d.trace_id, policy=policy, chosen=g.chosen.name, reason=g.reason, shadow=False,
                    weights=dict(scheduler.weights), candidates=cands, prompt_tokens=d.prompt_tokens,
                    available=g.available_tokens, predicted=g.predicted_tokens, speculative=g.speculative_tokens,
                    delivered=None, attempts=1, routing_ms=0.0)


def sentence(d: Decision, kv_weights: dict[str, float] | None = None) -> str:
    """One sentence for one decision; a cache-blind one also says what kv-aware (with `kv_weights`,
    default its preset's) would have done."""
    if not d.shadow:
        return f"{d.policy} ({d.reason}): {margin_sentence(d)}"
    text = f"{d.policy} sent it to {d.chosen} without looking at the cache"
    cf = counterfactual(d, weights=kv_weights)
    if cf is None:
        return text + " (the span lacks the per-replica inputs to say what kv-aware would have picked)"
    mine = next((c.total or 0.0 for c in cf.candidates if c.replica == d.chosen), None)
    best = max((c.total or 0.0 for c in cf.candidates), default=0.0)
    if cf.chosen == d.chosen or (mine is not None and best - mine < 0.005):
        return text + f"; kv-aware would have rated {d.chosen} as high as any ({cf.reason})"
    got = next((c.prefix_tokens or 0 for c in d.candidates if c.chosen), 0)
    return (text + f" ({got} cached tokens there); kv-aware would have picked {cf.chosen} "
            f"({cf.predicted} cached tokens, {cf.reason}): {margin_sentence(cf)}")


@dataclass(frozen=True)
class Selected:
    decision: Decision
    ttft_ms: float | None


def select(decisions: Iterable[tuple[Decision, float | None]], *, reason: str | None = None,
           replica: str | None = None, policy: str | None = None, worst: int | None = None) -> list[Selected]:
    """Decisions matching every given selector, in run order; `worst` keeps the N slowest by client
    TTFT (requests without a TTFT rank by prompt tokens the cache did not deliver)."""
    out = [Selected(d, t) for d, t in decisions
           if (reason is None or d.reason == reason) and (replica is None or d.chosen == replica)
           and (policy is None or d.policy == policy)]
    if worst is not None:
        def badness(s: Selected) -> tuple[int, float]:
            d = s.decision
            lost = (d.prompt_tokens or 0) - (d.delivered or 0)
            return (1, s.ttft_ms) if s.ttft_ms is not None else (0, float(lost))
        out = sorted(out, key=badness, reverse=True)[:worst]
    return out


def load_cells(c: Candidate) -> list[str]:
    """The raw load inputs of one candidate, formatted for the decision table."""
    cells: list[str] = []
    for key, _ in LOAD_COLUMNS:
        value: Any = c.extra.get(key)
        if not isinstance(value, int | float):
            cells.append("–")
        elif key == "kv_usage":
            cells.append(f"{value:.0%}")
        else:
            cells.append(f"{value:g}")
    return cells


def kv_weights_of(decisions: Iterable[Decision]) -> dict[str, float] | None:
    """The weights the run's own kv-aware decisions recorded (None if it had none)."""
    return next((d.weights for d in decisions if d.policy == "kv-aware" and not d.shadow and d.weights), None)


def reasons(decisions: Sequence[Decision]) -> dict[str, int]:
    """How many decisions each reason accounts for (for `--reason` hints)."""
    out: dict[str, int] = {}
    for d in decisions:
        out[d.reason or "?"] = out.get(d.reason or "?", 0) + 1
    return out


def resumes(trace: Trace) -> list[str]:
    """One sentence per resume of the request (a replica that failed mid-way, gateway/resume.py)."""
    out = []
    for span in trace.find(names.SPAN_GATEWAY_REQUEST):
        for ev in span.events:
            if ev.name != names.EVENT_RESUME:
                continue
            a = ev.attributes
            sent = a.get(names.RESUME_TOKENS_SENT, 0)
            what = (f"after {sent} tokens had reached the client; {a.get(names.REPLICA, '?')} continued the "
                    "same generation from that text" if sent
                    else f"before any token reached the client; {a.get(names.REPLICA, '?')} served it from the start")
            out.append(f"resume {a.get(names.RESUME_INDEX, '?')}: {a.get(names.RESUME_FROM, '?')} failed "
                       f"({a.get(names.RESUME_REASON, '?')}) {what}, prefilling about "
                       f"{a.get(names.RESUME_PREFILL_TOKENS, '?')} prompt tokens its cache did not hold")
    return out
