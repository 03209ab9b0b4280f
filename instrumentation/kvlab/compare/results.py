"""One row per router and workload: what `kvlab compare` prints and writes to compare.json.

The hit rate is the engine's (`cached_tokens` over prompt tokens of the successful requests, as
the engine reported them in each response's usage); its share of the oracle divides it by the
ceiling `kvlab.load.oracle` computes for exactly the requests that router completed, in the order
it sent them. Balance comes from the replicas' own request counters (`vllm:request_success_total`
before and after; on a cluster read through the API server's pod proxy), so it holds for routers
that say nothing about where they sent a request.
"""

from __future__ import annotations

from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table

from kvlab.gateway.tokens import PromptTokenizer
from kvlab.load.measure import Record
from kvlab.load.oracle import Oracle, oracle, replayed
from kvlab.load.summary import Summary
from kvlab.load.workloads import Workload
from kvlab.telemetry import names


class Row(msgspec.Struct, kw_only=True):
    """One router on one workload (compare.json `workloads.<w>.routers[]`; docs/compare.md)."""

    router: str
    peer: bool
    requests: int
    ok: int
    errors: int
    first_error: str | None
    hit_rate: float | None             # engine: sum(cached_tokens) / sum(prompt_tokens)
    oracle_hit_rate: float | None      # the ceiling for the same requests on the same capacity
    share_of_oracle: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None           # per-request mean inter-token latency, median
    itl_p95_ms: float | None
    rps: float
    output_tok_s: float
    replica_requests: dict[str, int]   # from each replica's own counter
    max_load: float | None             # busiest replica's share / an even share (1.0 = even)
    peer_counters: dict[str, float] = {}   # the peer's own `vllm_router_kv_*` counters at the end
    # open loop (None for closed-loop users): docs/open-loop.md
    offered_rps: float | None = None
    sent_rps: float | None = None       # what the phase actually sent per second of its length
    arrival: str | None = None
    itl_p99_ms: float | None = None     # every gap between two tokens, p99 (vLLM's ITL percentiles)
    goodput_rps: float | None = None    # requests/s that met the run's SLO on TTFT and TPOT
    late: int | None = None             # sends more than LATE_MS after their scheduled time
    unfinished: int | None = None       # still running when the phase ended


# vllm-router's `vllm_router_kv_placement_lookups_total{result=...}` values that credit no cached
# prefix, and its `vllm_router_kv_routing_inputs_total` result when it got no prompt tokens at all
NO_CREDIT = ('result="miss"', 'result="missing_tokens"')
NO_TOKENS = 'result="preparation_rejected"'
KV_PREFIX = "vllm_router_kv_"


def metric_counters(text: str, prefix: str) -> dict[str, float]:
    """`name{label="value",...}` -> value of every counter sample in a Prometheus page named `prefix*`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix) and s.name.endswith("_total"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def kv_path_warning(r: Row) -> str | None:
    """What the peer's own counters say when its KV placement lookups never credited a cached
    prefix (so it routed by load alone); None when one did, or when it made no such lookups (a
    policy such as `cache_aware` also counts token preparations but places by text)."""
    lookups = {k: v for k, v in r.peer_counters.items() if "_placement_lookups_" in k}
    inputs = {k: v for k, v in r.peer_counters.items() if "_routing_inputs_" in k}
    missed = sum(v for k, v in lookups.items() if any(m in k for m in NO_CREDIT))
    if not lookups or missed != sum(lookups.values()):
        return None
    rejected = sum(v for k, v in inputs.items() if NO_TOKENS in k)
    why = (f"every KV token preparation was rejected ({rejected:.0f}), so none of its {missed:.0f} KV "
           "placement lookups had the prompt's tokens" if rejected and rejected == sum(inputs.values())
           else f"none of its {missed:.0f} KV placement lookups credited a cached prefix")
    return f"{r.router}: {why}; it routed by load alone (docs/compare.md, \"Is a peer's KV path engaged?\")"


def request_counts(pages: dict[str, list[str]]) -> dict[str, float]:
    """Each replica's `vllm:request_success_total` in its Prometheus pages (a stack's `replica_metrics()`)."""
    wanted = names.VLLM_REQUEST_SUCCESS + "_total"
    return {replica: sum(s.value for text in texts for f in text_string_to_metric_families(text)
                         for s in f.samples if s.name == wanted) for replica, texts in pages.items()}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def row(router: str, peer: bool, summary: Summary, ceiling: Oracle | None,
        before: dict[str, float], after: dict[str, float], peer_counters: dict[str, float]) -> Row:
    """The row of one router's run: its summary.json, the oracle, the replicas' counters and the
    peer's own."""
    served = {n: int(after[n] - before.get(n, 0.0)) for n in after}
    total = sum(served.values())
    hit = summary.hit_rate.delivered
    top = ceiling.hit_rate if ceiling is not None and ceiling.prompt_tokens else None
    ttft, itl, loop = summary.ttft_ms, summary.itl_ms, summary.open_loop
    return Row(router=router, peer=peer, requests=summary.requests, ok=summary.ok, errors=summary.errors,
               first_error=summary.first_error, hit_rate=hit,
               oracle_hit_rate=round(top, 4) if top is not None else None, share_of_oracle=_ratio(hit, top),
               ttft_p50_ms=ttft.p50, ttft_p95_ms=ttft.p95, ttft_p99_ms=ttft.p99,
               itl_p50_ms=itl.p50, itl_p95_ms=itl.p95, rps=summary.rps,
               output_tok_s=summary.output_tok_s, replica_requests=served, peer_counters=peer_counters,
               max_load=round(max(served.values()) * len(served) / total, 3) if total else None,
               itl_p99_ms=summary.token_itl_ms.p99, goodput_rps=summary.goodput.rps if summary.goodput else None,
               offered_rps=loop.offered_rps if loop else None, sent_rps=loop.sent_rps if loop else None,
               arrival=loop.arrival if loop else None,
               late=loop.late if loop else None, unfinished=loop.unfinished if loop else None)


def ceiling_for(workload: Workload[Any], records: list[Record], block_size: int, replicas: int,
                blocks_per_replica: int | None, tokenizer: PromptTokenizer) -> Oracle | None:
    """The oracle for the requests one router completed (None: no request to judge)."""
    sent = replayed(workload, records)
    return oracle(sent, block_size, replicas, blocks_per_replica, tokenizer) if sent else None


def _f(value: float | None, fmt: str) -> str:
    return fmt.format(value) if value is not None else "–"


COLUMNS: list[tuple[str, str]] = [   # (header, what it shows); docs/compare.md explains each
    ("router", "kvlab preset or peer"),
    ("hit rate", "engine cached / prompt tokens"),
    ("of oracle", "hit rate / oracle hit rate"),
    ("TTFT p50", "ms"), ("p95", "ms"), ("p99", "ms"),
    ("ITL p50", "ms, per-request mean"),
    ("req/s", "completed requests per second"),
    ("tok/s", "output tokens per second"),
    ("errors", "failed / sent"),
    ("balance", "requests per replica (max load: busiest ÷ even share)"),
]


def cells(r: Row) -> list[str]:
    """A row as the terminal table and the HTML table show it."""
    spread = "/".join(str(v) for v in r.replica_requests.values())
    return [f"{r.router}{' (peer)' if r.peer else ''}", _f(r.hit_rate, "{:.3f}"), _f(r.share_of_oracle, "{:.0%}"),
            _f(r.ttft_p50_ms, "{:.0f}"), _f(r.ttft_p95_ms, "{:.0f}"), _f(r.ttft_p99_ms, "{:.0f}"),
            _f(r.itl_p50_ms, "{:.1f}"), f"{r.rps:.2f}", f"{r.output_tok_s:.0f}", f"{r.errors}/{r.requests}",
            f"{spread} ({_f(r.max_load, '{:.2f}')})"]


def table(workload: str, rows: list[Row], oracle_note: str) -> RouterTable:
    """The terminal table of one workload: a column per figure where the console is wide enough,
    else a row per figure and a column per router, so no figure is ever cut ("0.3…")."""
    return RouterTable(f"{workload} · {oracle_note}", rows)


class RouterTable:
    """Rows of routers, laid out for the width it is printed at (a log's 80 columns included)."""

    def __init__(self, title: str, rows: list[Row]) -> None:
        self.title = title
        self.rows = rows

    def wide(self) -> Table:
        t = Table(title=self.title, title_justify="left")
        for i, (header, _) in enumerate(COLUMNS):
            t.add_column(header, justify="left" if i == 0 else "right", no_wrap=0 < i < len(COLUMNS) - 1)
        for r in self.rows:
            t.add_row(*cells(r))
        return t

    def narrow(self, rows: list[Row], title: str | None) -> Table:
        """A row per figure, a column per router (names wrap); balance as the max load alone."""
        t = Table(title=title, title_justify="left")
        t.add_column("", no_wrap=True)
        for r in rows:
            t.add_column(f"{r.router}{' (peer)' if r.peer else ''}", justify="right", overflow="fold")
        by_router = [cells(r) for r in rows]
        for i, (header, _) in enumerate(COLUMNS[1:-1], 1):
            t.add_row(header if header not in ("p95", "p99") else f"TTFT {header}", *(c[i] for c in by_router))
        t.add_row("max load", *(_f(r.max_load, "{:.2f}") for r in rows))
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = self.wide()
        if Measurement.get(console, options.update_width(10_000), wide).maximum <= options.max_width:
            yield wide
            return
        per = max(1, (options.max_width - 14) // 12)   # router columns of 12 hold every figure whole
        for i in range(0, len(self.rows), per):
            yield self.narrow(self.rows[i:i + per], self.title if i == 0 else None)
