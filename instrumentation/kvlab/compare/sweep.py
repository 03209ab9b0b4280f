"""A rate sweep: each router's latency, throughput and goodput against the offered rate.

`kvlab compare --rates R1,R2,...` runs every router at every rate (one compare section per
workload and rate); this gathers those rows into one curve per router and finds its saturation
knee: the highest offered rate the router still kept up with, completing at least KEEP_UP of the
requests per second the phase sent (a trace's start may send slower or faster than its mean rate)
with none left unfinished (docs/open-loop.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
from rich.table import Table

from kvlab.compare.results import Row
from kvlab.load.summary import Slo, Summary

KEEP_UP = 0.9


class Point(msgspec.Struct, kw_only=True):
    """One router at one offered rate."""

    offered_rps: float
    sent_rps: float | None     # what was sent per second of the phase (None: an older result)
    rps: float
    goodput_rps: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    hit_rate: float | None
    oracle_hit_rate: float | None
    late: int | None
    unfinished: int | None
    errors: int
    requests: int


class Curve(msgspec.Struct, kw_only=True):
    router: str
    points: list[Point]
    knee_rps: float | None    # highest offered rate kept up with (None: not even the lowest)


class Sweep(msgspec.Struct, kw_only=True):
    """compare.json `sweeps.<workload>`: the sections it gathers, the SLO, a curve per router."""

    workload: str
    sections: list[str]
    slo: Slo
    curves: list[Curve]


def kept_up(p: Point) -> bool:
    return p.rps >= KEEP_UP * (p.sent_rps if p.sent_rps is not None else p.offered_rps) and not p.unfinished


def knee(points: Sequence[Point]) -> float | None:
    """The highest offered rate up to which every point kept up (None: the lowest did not)."""
    best = None
    for p in sorted(points, key=lambda p: p.offered_rps):
        if not kept_up(p):
            break
        best = p.offered_rps
    return best


def point(r: Row) -> Point:
    return Point(offered_rps=r.offered_rps or 0.0, sent_rps=r.sent_rps, rps=r.rps, goodput_rps=r.goodput_rps,
                 ttft_p50_ms=r.ttft_p50_ms,
                 ttft_p99_ms=r.ttft_p99_ms, itl_p99_ms=r.itl_p99_ms, hit_rate=r.hit_rate,
                 oracle_hit_rate=r.oracle_hit_rate, late=r.late, unfinished=r.unfinished, errors=r.errors,
                 requests=r.requests)


def sweep(workload: str, sections: Mapping[str, Sequence[Row]], slo: Slo) -> Sweep:
    """The curves of one workload's sections (one per offered rate), routers in their order."""
    routers = list(dict.fromkeys(r.router for rows in sections.values() for r in rows))
    curves = []
    for name in routers:
        points = sorted((point(r) for rows in sections.values() for r in rows if r.router == name),
                        key=lambda p: p.offered_rps)
        curves.append(Curve(router=name, points=points, knee_rps=knee(points)))
    return Sweep(workload=workload, sections=list(sections), slo=slo, curves=curves)


def from_summaries(workload: str, phases: Mapping[str, Summary]) -> Sweep | None:
    """A lab's open-loop phases as a sweep (a curve per policy), when they offered two rates or more."""
    open_ = {name: s for name, s in phases.items() if s.open_loop is not None}
    if len({s.open_loop.offered_rps for s in open_.values() if s.open_loop}) < 2:
        return None
    curves: dict[str, list[Point]] = {}
    for s in open_.values():
        loop = s.open_loop
        assert loop is not None
        curves.setdefault(s.policy or "?", []).append(Point(
            offered_rps=loop.offered_rps, sent_rps=loop.sent_rps, rps=s.rps,
            goodput_rps=s.goodput.rps if s.goodput else None,
            ttft_p50_ms=s.ttft_ms.p50, ttft_p99_ms=s.ttft_ms.p99, itl_p99_ms=s.token_itl_ms.p99,
            hit_rate=s.hit_rate.delivered, oracle_hit_rate=None, late=loop.late, unfinished=loop.unfinished,
            errors=s.errors, requests=s.requests))
    slo = next((s.goodput.slo for s in open_.values() if s.goodput), Slo())
    return Sweep(workload=workload, sections=list(open_), slo=slo,
                 curves=[Curve(router=k, points=sorted(v, key=lambda p: p.offered_rps), knee_rps=knee(v))
                         for k, v in curves.items()])


def _f(value: float | None, fmt: str) -> str:
    return fmt.format(value) if value is not None else "–"


HEADERS = ["router", "offered req/s", "sent req/s", "req/s", "goodput", "TTFT p50", "TTFT p99", "ITL p99", "hit rate",
           "oracle", "late", "unfinished"]


def rows_of(s: Sweep) -> list[list[str]]:
    """The sweep's cells, a row per router and rate (the terminal, the HTML and docs tables)."""
    out = []
    for c in s.curves:
        for p in c.points:
            out.append([c.router, f"{p.offered_rps:g}", _f(p.sent_rps, "{:.2f}"), f"{p.rps:.2f}",
                        _f(p.goodput_rps, "{:.2f}"),
                        _f(p.ttft_p50_ms, "{:.0f}"), _f(p.ttft_p99_ms, "{:.0f}"), _f(p.itl_p99_ms, "{:.0f}"),
                        _f(p.hit_rate, "{:.3f}"), _f(p.oracle_hit_rate, "{:.3f}"), _f(p.late, "{}"),
                        _f(p.unfinished, "{}")])
    return out


def behind(s: Sweep) -> bool:
    """Whether the dispatcher fell behind (over 1 % of sends late) at any point of the sweep."""
    return any((p.late or 0) > 0.01 * max(1, p.requests) for c in s.curves for p in c.points)


def knees(s: Sweep) -> str:
    """One line: each router's knee."""
    return " · ".join(f"{c.router}: {_f(c.knee_rps, '{:g} req/s')}" if c.knee_rps is not None
                      else f"{c.router}: below {c.points[0].offered_rps:g} req/s" for c in s.curves if c.points)


def table(s: Sweep) -> Table:
    """The terminal table of one sweep."""
    t = Table(title=f"{s.workload} · rate sweep · goodput SLO: TTFT ≤ {s.slo.ttft_ms:g} ms, TPOT ≤ "
                    f"{s.slo.tpot_ms:g} ms · latencies in ms", title_justify="left",
              caption=f"saturation knee (completed ≥ {KEEP_UP:.0%} of the sent rate): {knees(s)}",
              caption_justify="left")
    for i, h in enumerate(HEADERS):
        t.add_column(h, justify="left" if i == 0 else "right")
    for cells in rows_of(s):
        t.add_row(*cells)
    return t
