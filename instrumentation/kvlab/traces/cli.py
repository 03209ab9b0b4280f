"""`kvlab traces list|show|explain`: a run's traces in the terminal (rich) and as HTML (plotly).

    kvlab traces list    [--run DIR | --jaeger URL] [--limit N] [--service NAME] [--policy NAME]
    kvlab traces show    TRACE_ID [--run DIR | --jaeger URL] [--html OUT]
    kvlab traces explain [TRACE_ID] [--run DIR | --jaeger URL] [--policy NAME] [--html OUT]
                         [--reason R] [--replica NAME] [--worst N] [--limit N] [--all-scorers]

Without --run or --jaeger the run is runs/latest. `explain` without a trace id picks a sample
request (the newest gateway request that had a cached prefix somewhere) and prints its
candidates (weighted scores, raw queue/running/in-flight/KV use, cached prefix), one sentence
saying which scorers decided (for a cache-blind policy: what kv-aware would have picked), the
three hit-rate numbers, then the run's decomposition per policy joined with client TTFT. With
--reason, --replica or --worst it prints one sentence per matching decision instead.
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from kvlab.errors import KvlabError
from kvlab.telemetry import names as n
from kvlab.traces import explain
from kvlab.traces.decision import Decision, decision_of
from kvlab.traces.hitrate import RequestHits, request_hits, summarize
from kvlab.traces.run import load_requests
from kvlab.traces.sources import TraceSource, open_source
from kvlab.traces.span import Trace
from kvlab.vocabulary import old_spelling

_SHOW_KEYS = (n.POLICY, n.REPLICA, n.SCHEDULE_CHOSEN, n.SCHEDULE_REASON, n.PROMPT_TOKENS,
              n.PREFIX_AVAILABLE_TOKENS, n.PREFIX_PREDICTED_TOKENS, n.PREFIX_DELIVERED_TOKENS,
              n.ENGINE_QUEUE_MS, n.ENGINE_CACHED_TOKENS, n.ENGINE_COMPUTED_TOKENS, n.ENGINE_BATCH_SIZE,
              n.PD_DECISION, n.PD_REASON, n.HTTP_RESPONSE_STATUS_CODE, n.ERROR_TYPE)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab traces", description="List, show and explain the traces of a run.")
    sub = p.add_subparsers(dest="command", required=True)

    def source_flags(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--run-dir", type=Path, help="a run directory (default runs/latest)")
        old_spelling(g, "--run", "--run-dir", type=Path)
        g.add_argument("--jaeger", metavar="URL", help="a Jaeger v2 query service, e.g. http://127.0.0.1:16686")

    ls = sub.add_parser("list", help="recent traces, one row each")
    source_flags(ls)
    ls.add_argument("--limit", type=int, default=20, help="at most this many traces (default 20)")
    ls.add_argument("--service", help="only traces with a span of this service")
    ls.add_argument("--policy", help="only requests routed under this policy")
    show = sub.add_parser("show", help="one trace as a span tree (and a waterfall with --html)")
    source_flags(show)
    show.add_argument("trace_id", help="trace id (a unique prefix is enough for span files)")
    show.add_argument("--html", type=Path, metavar="OUT", help="write the waterfall to this HTML file")
    ex = sub.add_parser("explain", help="why a request went where it went, and what the cache delivered")
    source_flags(ex)
    ex.add_argument("trace_id", nargs="?", help="default: a sample request of the run")
    ex.add_argument("--policy", help="pick the sample among requests of this policy")
    ex.add_argument("--resumed", action="store_true",
                    help="pick a request whose replica failed mid-way and that was resumed on another")
    ex.add_argument("--html", type=Path, metavar="OUT", help="write waterfall, why-this-replica and hit-rate figures")
    ex.add_argument("--reason", help="explain every decision with this reason (e.g. load-over-prefix, round-robin)")
    ex.add_argument("--replica", help="explain every decision that chose this replica")
    ex.add_argument("--worst", type=int, metavar="N", help="explain the N requests with the highest client TTFT")
    ex.add_argument("--limit", type=int, default=10, help="at most this many sentences with --reason/--replica")
    ex.add_argument("--all-scorers", action="store_true", help="also show scorers whose weight is zero")
    return p


def _find(source: TraceSource, trace_id: str) -> Trace:
    trace_id = trace_id.lower()
    if len(trace_id) == 32:
        return source.trace(trace_id)
    matches = [t for t in source.traces() if t.trace_id.startswith(trace_id)]
    if len(matches) != 1:
        raise KvlabError(f"{len(matches)} traces start with {trace_id!r} in {source.describe()}")
    return matches[0]


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _pct(part: int | None, whole: int | None) -> str:
    if part is None:
        return "?"
    return f"{part} ({part / whole:.0%})" if whole else str(part)


def cmd_list(source: TraceSource, args: argparse.Namespace, console: Console) -> int:
    requests = ({r.trace_id.lower(): r for r in load_requests(args.run_dir) if r.trace_id}
                if not args.jaeger else {})
    traces = source.traces(service=args.service)
    rows = []
    for t in reversed(traces):
        d = decision_of(t)
        if args.policy and (d is None or d.policy != args.policy):
            continue
        rows.append((t, d))
        if len(rows) >= args.limit:
            break
    table = Table(title=f"{len(rows)} of {len(traces)} traces — {source.describe()}")
    numeric = {"ms", "spans", "prompt", "avail", "pred", "deliv", "client TTFT ms"}
    for col in ("trace id", "start", "root span", "ms", "spans", "services", "policy", "replica",
                "prompt", "avail", "pred", "deliv", "client TTFT ms"):
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=col in {"trace id", "start"})
    for t, d in reversed(rows):
        client = requests.get(t.trace_id)
        table.add_row(
            t.trace_id, datetime.fromtimestamp(t.start_ns / 1e9).strftime("%H:%M:%S.%f")[:-3], t.root.name,
            f"{t.duration_ms:.1f}", str(len(t)), ",".join(t.services),
            _fmt(d.policy if d else None), _fmt(d.chosen if d else None),
            _fmt(d.prompt_tokens if d else None), _fmt(d.available if d else None),
            _fmt(d.predicted if d else None), _fmt(d.delivered if d else None),
            _fmt(client.ttft_ms if client else None))
    console.print(table)
    return 0


def _tree(trace: Trace) -> Tree:
    root = Tree(f"[bold]trace {trace.trace_id}[/] {trace.duration_ms:.1f} ms, services {', '.join(trace.services)}")
    t0 = trace.start_ns
    nodes: dict[str | None, Tree] = {None: root}
    for _, s in trace.walk():
        attrs = " ".join(f"{k.removeprefix('kvlab.')}={s.attributes[k]}" for k in _SHOW_KEYS if k in s.attributes)
        style = "red" if s.status == "error" else "cyan"
        label = (f"[{style}]{s.name}[/] [dim]{s.service} {s.kind}[/] +{(s.start_ns - t0) / 1e6:.1f} ms "
                 f"[bold]{s.duration_ms:.2f} ms[/] {attrs}")
        parent = nodes.get(s.parent_id, root)
        nodes[s.span_id] = parent.add(label)
    return root


def cmd_show(source: TraceSource, args: argparse.Namespace, console: Console) -> int:
    trace = _find(source, args.trace_id)
    console.print(_tree(trace))
    if args.html:
        from kvlab.traces.figures import waterfall_figure, write_html

        out = write_html([waterfall_figure(trace)], args.html, f"kvlab trace {trace.trace_id}")
        console.print(f"waterfall written to {out}")
    return 0


def sample_request(rows: list[RequestHits], policy: str | None = None) -> RequestHits | None:
    """The newest request (of `policy`) that had a cached prefix somewhere, else the newest one."""
    rows = [r for r in rows if policy is None or r.policy == policy]
    with_cache = [r for r in rows if r.available > 0]
    candidates = with_cache or rows
    return candidates[-1] if candidates else None


def decision_table(d: Decision, all_scorers: bool = False, title: str | None = None) -> Table:
    """Candidates with their weighted scores (zero-weight scorers only with `all_scorers`), total,
    cached prefix and the raw load the scorers saw."""
    scorers = explain.visible_scorers(d, all_scorers)
    table = Table(title=f"{title or 'candidates'} — policy {d.policy}, chosen {d.chosen}, reason {d.reason}"
                        + (" (shadow scores: not used by the policy)" if d.shadow else ""))
    table.add_column("replica")
    for s in scorers:
        table.add_column(f"{s} ×{d.weights[s]:g}" if s in d.weights else s, justify="right")
    table.add_column("total", justify="right")
    table.add_column("cached prefix", justify="right")
    for _, label in explain.LOAD_COLUMNS:
        table.add_column(label, justify="right")
    for c in d.candidates:
        style = "bold green" if c.chosen else None
        table.add_row(("★ " if c.chosen else "  ") + c.replica,
                      *[f"{c.scores[s]:.3f}" if s in c.scores else "–" for s in scorers],
                      f"{c.total:.3f}" if c.total is not None else "–", _fmt(c.prefix_tokens),
                      *explain.load_cells(c), style=style)
    return table


def explain_lines(d: Decision, ttft_ms: float | None) -> list[str]:
    prompt = d.prompt_tokens
    lines = [f"trace {d.trace_id}: routed to [bold]{d.chosen}[/] by policy [bold]{d.policy}[/] "
             f"(reason {d.reason}, {d.attempts} attempt(s), routing {d.routing_ms:.2f} ms)",
             f"  prompt tokens              {_fmt(prompt)}",
             f"  available (any replica)    {_pct(d.available, prompt)}",
             f"  predicted (chosen replica) {_pct(d.predicted, prompt)}",
             f"    of it speculative        {_pct(d.speculative, prompt)}",
             f"  delivered (engine reused)  {_pct(d.delivered, prompt)}"]
    if d.available is not None and d.predicted is not None:
        lines.append(f"  lost to routing            {d.available - d.predicted} tokens")
    if d.predicted is not None and d.delivered is not None:
        lines.append(f"  lost to index / eviction   {d.predicted - d.delivered} tokens")
    lines.append(f"  client TTFT                {_fmt(ttft_ms)} ms")
    return lines


def summary_table(rows: list[RequestHits]) -> Table:
    table = Table(title="hit-rate decomposition by policy (token-weighted) joined with client TTFT")
    for col in ("policy", "requests", "available", "predicted", "delivered", "TTFT p50 ms", "TTFT p95 ms", "joined"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for policy, s in summarize(rows).items():
        table.add_row(policy, f"{s['requests']:.0f}", f"{s['available']:.1%}", f"{s['predicted']:.1%}",
                      f"{s['delivered']:.1%}", _fmt(s["ttft_p50_ms"]), _fmt(s["ttft_p95_ms"]), f"{s['joined']:.0f}")
    return table


def cmd_explain_many(traces: list[Trace], rows: list[RequestHits], args: argparse.Namespace,
                     console: Console) -> int:
    """One sentence per decision chosen by --reason/--replica/--worst/--policy."""
    ttft = {r.trace_id: r.ttft_ms for r in rows}
    decisions = [(d, ttft.get(t.trace_id)) for t in traces if (d := decision_of(t)) is not None]
    picked = explain.select(decisions, reason=args.reason, replica=args.replica, policy=args.policy,
                            worst=args.worst)
    wanted = ", ".join(f"{k} {v}" for k, v in (("reason", args.reason), ("replica", args.replica),
                                               ("policy", args.policy), ("worst", args.worst)) if v is not None)
    if not picked:
        counts = explain.reasons([d for d, _ in decisions])
        raise KvlabError(f"no decision with {wanted}; reasons in this run: "
                         + ", ".join(f"{k} ({v})" for k, v in sorted(counts.items())))
    kv = explain.kv_weights_of(d for d, _ in decisions)
    shown = picked if args.worst is not None else picked[: args.limit]
    console.print(f"[bold]{len(picked)} decisions[/] with {wanted}"
                  + (f" (first {len(shown)}; --limit to see more)" if len(shown) < len(picked) else ""))
    for s in shown:
        d = s.decision
        console.print(f"[cyan]{d.trace_id[:12]}[/] TTFT {_fmt(s.ttft_ms)} ms, prompt {_fmt(d.prompt_tokens)}, "
                      f"delivered {_fmt(d.delivered)}: {explain.sentence(d, kv)}")
    return 0


def cmd_explain(source: TraceSource, args: argparse.Namespace, console: Console) -> int:
    traces = source.traces()
    rows = request_hits(traces, [] if args.jaeger else load_requests(args.run_dir))
    if not args.trace_id and (args.reason or args.replica or args.worst is not None):
        return cmd_explain_many(traces, rows, args, console)
    if args.trace_id:
        trace = _find(source, args.trace_id)
    elif args.resumed:
        found = next((t for t in traces if explain.resumes(t)), None)
        if found is None:
            raise KvlabError(f"no resumed request in {source.describe()}")
        trace = found
    else:
        sample = sample_request(rows, args.policy)
        if sample is None:
            raise KvlabError(f"no gateway request with a schedule span in {source.describe()}")
        trace = source.trace(sample.trace_id)
    d = decision_of(trace)
    if d is None:
        raise KvlabError(f"trace {trace.trace_id} has no {n.SPAN_SCHEDULE} span (not a gateway request)")
    ttft = next((r.ttft_ms for r in rows if r.trace_id == trace.trace_id), None)
    console.print(decision_table(d, args.all_scorers))
    kv = explain.kv_weights_of(x for t in traces if (x := decision_of(t)) is not None) if d.shadow else None
    cf = explain.counterfactual(d, weights=kv) if d.shadow else None
    if cf is not None and cf.chosen != d.chosen:     # the sentence weighs kv-aware's terms: show them
        console.print(decision_table(cf, args.all_scorers, title="what kv-aware would have scored on the same inputs"))
    console.print(explain.sentence(d, kv))
    for line in explain_lines(d, ttft):
        console.print(line)
    for line in explain.resumes(trace):
        console.print(f"  [yellow]{line}[/]")
    if rows:
        console.print(summary_table(rows))
    if args.html:
        from kvlab.traces.figures import decision_figure, hitrate_figure, waterfall_figure, write_html

        figs = [decision_figure(d, args.all_scorers), waterfall_figure(trace)]
        figs += [hitrate_figure(rows)] if rows else []
        out = write_html(figs, args.html, f"kvlab: why trace {trace.trace_id} went to {d.chosen}")
        console.print(f"figures written to {out}")
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=180)
    try:
        source = open_source(args.run_dir, args.jaeger)
        return {"list": cmd_list, "show": cmd_show, "explain": cmd_explain}[args.command](source, args, console)
    except KvlabError as exc:
        console.print(f"[red]kvlab traces:[/] {exc}")
        return 1
