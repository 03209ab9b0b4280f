"""The terminal view of one or more run summaries (phases side by side, with the change)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rich.table import Table

from kvlab.load.summary import Summary

Metric = Callable[[Summary], float | None]

# (label, the metric, format, better) ; better: "low" | "high" | None. A row no phase has a value for
# (the open-loop rows of closed-loop phases) is left out.
ROWS: list[tuple[str, Metric, str, str | None]] = [
    ("requests ok", lambda s: s.ok, "{:.0f}", "high"),
    ("errors", lambda s: s.errors, "{:.0f}", "low"),
    ("TTFT p50 (ms)", lambda s: s.ttft_ms.p50, "{:.0f}", "low"),
    ("TTFT p95 (ms)", lambda s: s.ttft_ms.p95, "{:.0f}", "low"),
    ("TTFT p99 (ms)", lambda s: s.ttft_ms.p99, "{:.0f}", "low"),
    ("ITL p50 (ms)", lambda s: s.itl_ms.p50, "{:.1f}", "low"),
    ("ITL p99, every gap (ms)", lambda s: s.token_itl_ms.p99, "{:.0f}", "low"),
    ("worst gap p95 (ms)", lambda s: s.itl_max_ms.p95, "{:.0f}", "low"),
    ("E2E p50 (ms)", lambda s: s.e2e_ms.p50, "{:.0f}", "low"),
    ("throughput (req/s)", lambda s: s.rps, "{:.2f}", "high"),
    ("output tokens/s", lambda s: s.output_tok_s, "{:.0f}", "high"),
    ("offered (req/s)", lambda s: s.open_loop.offered_rps if s.open_loop else None, "{:.2f}", None),
    ("goodput (req/s, SLO met)", lambda s: s.goodput.rps if s.goodput else None, "{:.2f}", "high"),
    ("sends late (> 50 ms)", lambda s: s.open_loop.late if s.open_loop else None, "{:.0f}", "low"),
    ("unfinished at the end", lambda s: s.open_loop.unfinished if s.open_loop else None, "{:.0f}", "low"),
    ("hit rate available", lambda s: s.hit_rate.available, "{:.0%}", None),
    ("hit rate predicted", lambda s: s.hit_rate.predicted, "{:.0%}", "high"),
    ("hit rate delivered", lambda s: s.hit_rate.delivered, "{:.0%}", "high"),
]
SAME = 0.03   # a change smaller than this share of the before value prints as "≈"


def _change(before: float | None, after: float | None, better: str | None) -> str:
    """After against before: "=" the same, "≈" within 3 %, "12% lower" under 2×, "2.4× higher" beyond;
    green when better."""
    if before is None or after is None or better is None:
        return ""
    if before == after:
        return "="
    if before and abs(after - before) <= SAME * abs(before):
        return "≈"
    if not before:
        text = "new"
    else:
        ratio = max(after, before) / min(after, before) if min(after, before) > 0 else float("inf")
        way = "lower" if after < before else "higher"
        text = f"{abs(after - before) / before:.0%} {way}" if ratio < 2 else f"{ratio:.1f}× {way}"
    good = (after < before) if better == "low" else (after > before)
    return f"[green]{text}[/green]" if good else f"[red]{text}[/red]"


def _slo(phases: list[Summary]) -> str:
    """The SLO the goodput row counts (one per run), for the caption."""
    slos = {(s.goodput.slo.ttft_ms, s.goodput.slo.tpot_ms) for s in phases if s.goodput}
    if len(slos) != 1:
        return ""
    ttft, tpot = slos.pop()
    return f"goodput: requests with TTFT ≤ {ttft:g} ms and TPOT ≤ {tpot:g} ms"


def summary_table(summaries: Mapping[str, Summary], title: str | None = None) -> Table:
    """Rows = metrics, columns = phases; with exactly two phases a `change` column (green = better);
    the caption names the goodput's SLO."""
    pair = len(summaries) == 2
    phases = list(summaries.values())
    notes = [_slo(phases), "change: the second phase against the first, ≈ within 3 %" if pair else ""]
    table = Table(title=title, caption="\n".join(n for n in notes if n) or None)
    table.add_column("metric")
    for phase in summaries:
        table.add_column(phase, justify="right")
    if pair:
        table.add_column("change", justify="right")
    for label, metric, fmt, better in ROWS:
        values = [metric(s) for s in phases]
        if all(v is None for v in values):
            continue
        cells = [fmt.format(v) if v is not None else "n/a" for v in values]
        if pair:
            cells.append(_change(values[0], values[1], better))
        table.add_row(label, *cells)
    return table
