"""The terminal view of one or more run summaries (phases side by side, with the change)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

# (label, path into the summary, format, better) ; better: "low" | "high" | None
ROWS: list[tuple[str, tuple[str, ...], str, str | None]] = [
    ("requests ok", ("ok",), "{:.0f}", "high"),
    ("errors", ("errors",), "{:.0f}", "low"),
    ("TTFT p50 (ms)", ("ttft_ms", "p50"), "{:.0f}", "low"),
    ("TTFT p95 (ms)", ("ttft_ms", "p95"), "{:.0f}", "low"),
    ("TTFT p99 (ms)", ("ttft_ms", "p99"), "{:.0f}", "low"),
    ("ITL p50 (ms)", ("itl_ms", "p50"), "{:.1f}", "low"),
    ("ITL p99, every gap (ms)", ("token_itl_ms", "p99"), "{:.0f}", "low"),
    ("worst gap p95 (ms)", ("itl_max_ms", "p95"), "{:.0f}", "low"),
    ("E2E p50 (ms)", ("e2e_ms", "p50"), "{:.0f}", "low"),
    ("throughput (req/s)", ("rps",), "{:.2f}", "high"),
    ("output tokens/s", ("output_tok_s",), "{:.0f}", "high"),
    ("hit rate available", ("hit_rate", "available"), "{:.0%}", None),
    ("hit rate predicted", ("hit_rate", "predicted"), "{:.0%}", "high"),
    ("hit rate delivered", ("hit_rate", "delivered"), "{:.0%}", "high"),
]


def metric_value(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = summary
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, (int, float)) else None


def _change(before: float | None, after: float | None, better: str | None) -> str:
    if before is None or after is None or better is None:
        return ""
    if before == after:
        return "="
    if before and after and better == "low":
        text = f"{before / after:.1f}× lower" if after < before else f"{after / before:.1f}× higher"
    elif before:
        text = f"{after / before:.1f}×"
    else:
        text = "new"
    good = (after < before) if better == "low" else (after > before)
    return f"[green]{text}[/green]" if good else f"[red]{text}[/red]"


def summary_table(summaries: dict[str, dict[str, Any]], title: str | None = None) -> Table:
    """Rows = metrics, columns = phases; with exactly two phases a `change` column (green = better)."""
    table = Table(title=title)
    table.add_column("metric")
    for phase in summaries:
        table.add_column(phase, justify="right")
    pair = len(summaries) == 2
    if pair:
        table.add_column("change", justify="right")
    phases = list(summaries.values())
    for label, path, fmt, better in ROWS:
        values = [metric_value(s, path) for s in phases]
        cells = [fmt.format(v) if v is not None else "n/a" for v in values]
        if pair:
            cells.append(_change(values[0], values[1], better))
        table.add_row(label, *cells)
    return table
