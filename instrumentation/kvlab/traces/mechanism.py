"""Pictures of the mechanism, generated from a run's own data: why only prefixes are reusable
(chained block hashes of the workload's real token ids), where each prompt group's blocks live as
eviction churns (groups × replicas over time); plus three decisions of the run explained in words
(the hit-rate decomposition is the report's own bar chart). `section(run_dir, ...)` is the
report's hook; lab 02 calls the figure functions directly.

Residency comes from the decision spans: each records, for every replica, the cached prefix of
that request's prompt in the gateway's KV-event-fed index (BlockStored/BlockRemoved as the
replicas reported them). The run does not store the raw KV-event stream, so residency is known
at request times only, for the group being requested.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.errors import KvlabError
from kvlab.kvcache.hashing import block_keys
from kvlab.load.measure import Record
from kvlab.report.figures import figure_html
from kvlab.run.document import read_run
from kvlab.run.phases import PhaseResult
from kvlab.traces import explain
from kvlab.traces.decision import Decision, decision_of
from kvlab.traces.span import Trace

SAME, DIFFERENT = "#54A24B", "#E45756"
EVICTION_DROP = 0.25     # the index lost at least this fraction of the prompt on a replica: an eviction


def _layout(fig: go.Figure, title: str, height: int = 380) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", height=height, margin=dict(l=70, r=20, t=60, b=50))
    return fig


# ---- chained block hashing ----------------------------------------------------------------------

def prompt_tokens(workload: str, seed: int, params: dict[str, Any], n: int = 64) -> list[tuple[str, list[int]]]:
    """(group, token ids) of the first `n` requests the run's workload sends, tokenized as the
    gateway tokenizes a chat request (the default tokenizer's chat template)."""
    from kvlab.load.workloads import create
    from kvlab.tokenizer import Tokenizer

    tok = Tokenizer()
    out = []
    for req in create(workload, seed, params).requests(n):
        if req.messages:
            out.append((req.group or "?", tok.encode(tok.render_chat(list(req.messages)))))
    return out


def chain_figure(a: list[int], b: list[int], block_size: int, label_b: str = "another prompt of the group",
                 flip_at: int = 5) -> go.Figure:
    """Three prompts as rows of blocks, each block green where its chained key equals prompt A's
    at the same position: A itself, `b` (same system prompt, another question: shared blocks up
    to the question), and A with one token changed at position `flip_at` (every block from there
    on gets a new key, though the other tokens are identical)."""
    flipped = list(a)
    flipped[flip_at] = flipped[flip_at] + 1
    rows = [("A: a prompt of the run", a), (f"B: {label_b}", b), (f"A with token {flip_at} changed", flipped)]
    ref = block_keys(a, block_size)
    width = max(len(block_keys(t, block_size)) for _, t in rows)
    z, text, hover = [], [], []
    for name, tokens in rows:
        keys = block_keys(tokens, block_size)
        pad = width - len(keys)
        z.append([(1.0 if i < len(ref) and k == ref[i] else 0.0) for i, k in enumerate(keys)] + [np.nan] * pad)
        text.append([f"{k & 0xFFFF:04x}" for k in keys] + [""] * (width - len(keys)))
        hover.append([f"{name}<br>block {i}: tokens {i * block_size}–{(i + 1) * block_size - 1}<br>"
                      f"key …{k & 0xFFFFFFFF:08x} = hash(parent key, {tokens[i * block_size]}, …)"
                      for i, k in enumerate(keys)] + [""] * (width - len(keys)))
    shared = next((i for i, (x, y) in enumerate(zip(ref, block_keys(b, block_size))) if x != y), len(ref))
    fig = go.Figure(go.Heatmap(z=z, y=[r[0] for r in rows], text=text, hovertext=hover, hoverinfo="text",
                               colorscale=[[0, DIFFERENT], [1, SAME]], zmin=0, zmax=1, showscale=False,
                               xgap=1, ygap=4))
    fig.update_xaxes(title=f"block index ({block_size} tokens per block; key = hash(previous key, block's tokens))")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"Chained block hashes (green = same key as A): B reuses A's first {shared} blocks;<br>"
                        f"one token changed at position {flip_at} gives every block from there a new key", 320)


# ---- residency over time ------------------------------------------------------------------------

@dataclass
class Residency:
    """Per policy: the cached fraction of each group's prompt on each replica at each request."""

    groups: list[str]
    replicas: list[str]
    times: list[float] = field(default_factory=list)                  # seconds since the phase's first request
    states: list[dict[tuple[str, str], float]] = field(default_factory=list)   # after each request
    evictions: dict[tuple[str, str], int] = field(default_factory=dict)


def _group_key(g: str) -> tuple[int, str]:
    digits = "".join(ch for ch in g if ch.isdigit())
    return (int(digits) if digits else 0, g)


def residency(traces: Iterable[Trace], records: Iterable[Record]) -> dict[str, Residency]:
    """Residency per policy from the decision spans (every replica's cached prefix of the prompt in
    the KV-event index), joined with the client records' prompt group by trace id. An eviction is
    counted when a replica's cached prefix of a group drops by ≥ 25 % of the prompt between two
    requests of the group."""
    groups = {r.trace_id.lower(): r.group for r in records if r.trace_id and r.group}
    rows: dict[str, list[tuple[int, str, Decision]]] = {}
    for t in traces:
        d = decision_of(t)
        if d is not None and t.trace_id in groups and d.candidates and d.prompt_tokens:
            rows.setdefault(d.policy or "?", []).append((t.start_ns, groups[t.trace_id], d))
    out = {}
    for policy, items in rows.items():
        items.sort(key=lambda x: x[0])
        res = Residency(sorted({g for _, g, _ in items}, key=_group_key),
                        sorted({c.replica for _, _, d in items for c in d.candidates}))
        state: dict[tuple[str, str], float] = {}
        t0 = items[0][0]
        for start, g, d in items:
            for c in d.candidates:
                frac = min((c.prefix_tokens or 0) / (d.prompt_tokens or 1), 1.0)
                if state.get((g, c.replica), 0.0) - frac >= EVICTION_DROP:
                    res.evictions[(g, c.replica)] = res.evictions.get((g, c.replica), 0) + 1
                state[(g, c.replica)] = frac
            res.times.append((start - t0) / 1e9)
            res.states.append(dict(state))
        out[policy] = res
    return out


def _matrix(res: Residency, state: dict[tuple[str, str], float]) -> list[list[float]]:
    return [[state.get((g, r), 0.0) for r in res.replicas] for g in res.groups]


def _evictions(count: int) -> str:
    return "no eviction seen" if not count else f"{count} eviction{'s' if count > 1 else ''} seen"


def residency_figure(by_policy: dict[str, Residency], frames: int = 10) -> go.Figure:
    """Groups × replicas, one panel per policy: the cached fraction of each group's prompt on each
    replica (the slider steps through the phase; "mean" is the time average), the number in a cell
    is how many evictions of that group the replica reported."""
    policies = list(by_policy)
    fig = make_subplots(rows=1, cols=len(policies), subplot_titles=[
        f"{p}: {_evictions(sum(r.evictions.values()))}" for p, r in by_policy.items()], horizontal_spacing=0.08)

    def snapshot(res: Residency, k: int | None) -> tuple[list[list[float]], list[list[str]]]:
        if k is None:
            z = np.mean([_matrix(res, s) for s in res.states], axis=0).tolist() if res.states else []
        else:
            z = _matrix(res, res.states[k]) if res.states else []
        text = [[str(res.evictions.get((g, r), "")) for r in res.replicas] for g in res.groups]
        return z, text

    for i, res in enumerate(by_policy.values()):
        z, text = snapshot(res, None)
        fig.add_trace(go.Heatmap(z=z, x=res.replicas, y=res.groups, text=text, texttemplate="%{text}",
                                 zmin=0, zmax=1, colorscale="Blues", showscale=i == len(policies) - 1,
                                 colorbar=dict(title="cached", tickformat=".0%"),
                                 hovertemplate="group %{y} on %{x}: %{z:.0%} of the prompt cached<br>"
                                               "evictions seen: %{text}<extra></extra>"), row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed", row=1, col=i + 1, showticklabels=i == 0)
    steps = [dict(label="mean", method="restyle",
                  args=[{"z": [snapshot(r, None)[0] for r in by_policy.values()]}])]
    for f in range(1, frames + 1):
        zs, label = [], ""
        for res in by_policy.values():
            k = max(0, min(len(res.states) - 1, round(f / frames * len(res.states)) - 1))
            zs.append(snapshot(res, k)[0])
            label = f"{f / frames:.0%}"
        steps.append(dict(label=label, method="restyle", args=[{"z": zs}]))
    fig.update_layout(sliders=[dict(active=0, steps=steps, currentvalue=dict(prefix="phase progress: "),
                                    pad=dict(t=30))])
    height = max(420, 16 * max((len(r.groups) for r in by_policy.values()), default=0) + 200)
    return _layout(fig, "Where each prompt group's blocks live (KV-event index at each request)", height)


# ---- three decisions in words -------------------------------------------------------------------

def examples(decisions: list[Decision]) -> dict[str, Decision | None]:
    """A kv-aware hit, a round-robin miss (the prefix was elsewhere), and a load-over-prefix one."""
    def first(pred: Any) -> Decision | None:
        return next((d for d in decisions if pred(d)), None)

    return {
        "a hit": first(lambda d: not d.shadow and d.reason == "prefix" and (d.delivered or 0) > 0),
        "a round-robin miss": first(lambda d: d.shadow and (d.available or 0) > 0 and not d.predicted),
        "load over cache": first(lambda d: d.reason == "load-over-prefix"),
    }


def examples_html(decisions: list[Decision]) -> str:
    kv = explain.kv_weights_of(decisions)
    items = []
    for label, d in examples(decisions).items():
        if d is None:            # a run without such a decision: nothing to show, not an empty line
            continue
        items.append(f"<li><b>{label}</b> (<code>kvlab traces explain {d.trace_id[:12]}</code>): "
                     f"{html.escape(explain.sentence(d, kv))}</li>")
    return "<ul class=\"note\">" + "".join(items) + "</ul>" if items else ""


# ---- the report's section -----------------------------------------------------------------------

CHAIN_CAPTION = ("Three prompts as rows of KV blocks; a block is green where its key equals prompt A's at the same "
                 "position, and its label is the key's last four hex digits. A key hashes the previous block's key "
                 "with this block's tokens, so equal keys mean equal prefixes: B shares A's blocks up to where its "
                 "question starts, and one changed token gives every later block a new key. Only a common prefix "
                 "is reusable.")
RESIDENCY_CAPTION = ("One panel per phase: rows are prompt groups, columns replicas. A cell's shade is the share of "
                     "the group's prompt the gateway's KV-event index held on that replica, averaged over the phase "
                     "(\"mean\") or as it stood after 10 %, 20 %, … 100 % of the phase's requests (drag the \"phase "
                     "progress\" slider). The number in a cell counts evictions of that group from that replica: its "
                     "cached share fell by at least a quarter of the prompt between two requests of the group. A "
                     "cache-blind router smears each group over every column and keeps losing it; a cache-aware one "
                     "keeps each group in one column.")


@dataclass(frozen=True)
class Picture:
    figure: go.Figure
    caption: str        # what to look at


def figures(run_dir: Path, phases: Mapping[str, PhaseResult]) -> tuple[list[Picture], list[Decision]]:
    """The chain and residency figures of a run (those its data allows) and its decisions."""
    from kvlab.traces.sources.otlp_files import OtlpFileSource

    figs: list[Picture] = []
    doc = read_run(run_dir / "summary.json")
    wl = doc.workload or {}
    if isinstance(wl, str):          # lab 02 recorded the workload by name
        wl = {"name": wl, "seed": doc.seed}
    block = ((doc.topology or {}).get("sim") or {}).get("block_size") or 16
    if wl.get("name"):
        prompts = prompt_tokens(wl["name"], int(wl.get("seed") or 0), wl.get("params") or {})
        a = next(((g, t) for g, t in prompts), None)
        b = next((t for g, t in prompts[1:] if a and g == a[0]), None)
        if a is not None and b is not None:
            figs.append(Picture(chain_figure(a[1], b, int(block), f"another prompt of group {a[0]}"), CHAIN_CAPTION))
    decisions: list[Decision] = []
    traces_dir = run_dir / "traces"
    if traces_dir.is_dir():
        traces = OtlpFileSource(traces_dir).traces()
        decisions = [d for t in traces if (d := decision_of(t)) is not None]
        records = [r for v in phases.values() for r in v.records]
        res = residency(traces, records)
        if res:
            figs.append(Picture(residency_figure(res), RESIDENCY_CAPTION))
    return figs, decisions


def section(run_dir: Path | None, phases: Mapping[str, PhaseResult], config: dict[str, Any]) -> str:
    """The report's "why" section: the mechanism figures and three decisions in words (only for a
    run directory: it needs the run's summary.json and traces)."""
    if run_dir is None or not (run_dir / "summary.json").is_file():
        return ""
    try:
        figs, decisions = figures(run_dir, phases)
    except (KvlabError, OSError, ValueError, KeyError) as exc:   # the rest of the report still stands
        return f'<p class="note">The mechanism section could not be drawn: {html.escape(str(exc))}</p>'
    divs = "".join(figure_html(p.figure, p.caption, config) for p in figs)
    words = examples_html(decisions) if decisions else ""
    return f'<h2>Why: the mechanism in this run</h2><div class="mechanism">{divs}</div>{words}'
