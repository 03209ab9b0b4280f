"""`kvlab plan`: how many replicas (and GPUs) each routing policy needs to meet an SLO on a workload.

    kvlab plan --trace mooncake-conversation                     # round-robin and kv-aware, default SLO
    kvlab plan --trace my.jsonl --ttft-p90-ms 1000 --tpot-p90-ms 50 --policies round-robin,prefix,kv-aware
    kvlab plan --trace mooncake-conversation --policies round-robin,kv-aware,dynamo-kv-router   # + Dynamo's answer

Each policy's fewest replicas come from twin runs (docs/twin.md, "How many replicas?"): doubling
from --start until the SLO is met, then bisecting; each probe is printed as it finishes. kvlab's
policies are searched side by side, one process each (--jobs, as kvlab twin). The SLO
(defaults: TTFT p90 <= 2,000 ms and TPOT p90 <= 100 ms, over every request, errors as misses) may
add a TTFT p99 bound and a goodput share (requests meeting both per-request bounds). Writes
runs/<time>-plan/: plan.json and plan.html (goodput against replicas per policy). Figures are
from the twin (virtual time, simulated replicas), not a live run; a `dynamo-*` name (twin/dynamo.py)
is sized by the same search and SLO on the same trace rows, each probe Dynamo's own router and
mocker replayed with N workers: its rows are marked (peer), figures from Dynamo's simulator.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import plotly.graph_objects as go
from rich.console import Console
from rich.table import Table

from kvlab.config import convert
from kvlab.errors import ConfigError, TwinError
from kvlab.plan.search import Answer, Probe, Target, dynamo_replicas_needed, replicas_needed
from kvlab.run.command import fail
from kvlab.twin import dynamo
from kvlab.twin.cli import jobs_of, policies_of
from kvlab.twin.fit import describe
from kvlab.twin.runner import Stopped
from kvlab.twin.settings import TwinSettings, resolve
from kvlab.twin.workers import Report, side_by_side

DEFAULT_POLICIES = "round-robin,kv-aware"
DEFAULT_REQUESTS = 300   # the conversation trace's first ~90 s: both policies answered in minutes on 2 cores
SOURCE = "kvlab plan: twin runs (virtual time, simulated replicas), not a live run"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", metavar="NAME_OR_FILE", help="Mooncake trace name or file, replayed at its own timing")
    p.add_argument("--workload", metavar="NAME", help="workload name instead of a trace (default: the topology's)")
    p.add_argument("--workload-params", metavar="JSON", help="JSON object of workload parameters")
    p.add_argument("--rate", type=float, metavar="RPS",
                   help="open loop at this many requests/s (default with --workload: 8 users)")
    p.add_argument("--time-scale", type=float, metavar="FACTOR",
                   help="a trace's timestamps times this (0.5: twice its rate; default 1)")
    p.add_argument("--topology", default="quickstart", metavar="NAME",
                   help="shipped topology name or YAML path (default quickstart)")
    p.add_argument("--profile", metavar="NAME",
                   help="latency profile (default as kvlab twin: one that holds the trace)")
    p.add_argument("--num-blocks", type=int, metavar="N", help="KV blocks per replica (default: the profile's)")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="longest request a replica takes; longer ones are answered 400 (default: the profile's)")
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, metavar="N",
                   help=f"requests per probe (default {DEFAULT_REQUESTS})")
    p.add_argument("--policies", default=DEFAULT_POLICIES, metavar="NAMES",
                   help=f"routing policies to size, comma-separated (default {DEFAULT_POLICIES}); "
                        "dynamo-round-robin, dynamo-kv-router: Dynamo's own replay's answer beside them")
    p.add_argument("--ttft-p90-ms", type=float, default=2000.0, metavar="MS", help="TTFT p90 bound (default 2000)")
    p.add_argument("--ttft-p99-ms", type=float, metavar="MS", help="TTFT p99 bound (default: none)")
    p.add_argument("--tpot-p90-ms", type=float, default=100.0, metavar="MS", help="TPOT p90 bound (default 100)")
    p.add_argument("--goodput-share", type=float, metavar="SHARE",
                   help="least share of requests meeting both per-request bounds, 0-1 (default: none)")
    p.add_argument("--start", type=int, default=1, metavar="N", help="fewest replicas tried (default 1)")
    p.add_argument("--max-replicas", type=int, default=64, metavar="N", help="most replicas tried (default 64)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the workload, arrivals and engines (default 0)")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="policies searched side by side, one process each, N at a time (default: one per core, "
                        "at most 4; 1: one after another in this process)")
    p.add_argument("--run-dir", metavar="DIR", help="where plan.json and plan.html go (default runs/<time>-plan)")
    return p


def settings_of(args: argparse.Namespace) -> tuple[TwinSettings, Target]:
    data: dict[str, Any] = {"topology": args.topology, "requests": args.requests, "seed": args.seed}
    for key in ("trace", "workload", "rate", "time_scale", "profile", "num_blocks", "max_model_len"):
        if (value := getattr(args, key)) is not None:
            data[key] = value
    if args.workload_params is not None:
        try:
            data["workload_params"] = json.loads(args.workload_params)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--workload-params is not JSON: {exc}") from None
    slo = {"ttft_p90_ms": args.ttft_p90_ms, "ttft_p99_ms": args.ttft_p99_ms, "tpot_p90_ms": args.tpot_p90_ms,
           "goodput_share": args.goodput_share}
    return convert(data, TwinSettings, "flags"), convert(slo, Target, "flags")


def label(a: Answer) -> str:
    return f"{a.policy} (peer)" if a.peer else a.policy


def _ms(v: float, digits: int = 0) -> str:
    """A percentile in ms; one that falls among the errors (infinite) says so."""
    return f"{v:,.{digits}f} ms" if math.isfinite(v) else "∞ (errors)"


def probe_line(policy: str, p: Probe) -> str:
    return (f"{policy} · {p.replicas} replicas: TTFT p90 {_ms(p.ttft_p90_ms)}, p99 {_ms(p.ttft_p99_ms)}, "
            f"TPOT p90 {_ms(p.tpot_p90_ms, 1)}, goodput {p.goodput:.0%}, {p.errors} errors → "
            f"{'meets' if p.met else 'misses'} the SLO ({p.wall_s:.1f} s)")


def answer_table(answers: list[Answer], slo: Target) -> Table:
    peers = sorted({a.source for a in answers if a.peer})
    t = Table(title=f"fewest replicas for {slo.describe()} (twin)", title_justify="left",
              caption="; ".join(f"(peer) rows: {s}" for s in peers) or None, caption_justify="left")
    for h in ("policy", "replicas", "GPUs", "TTFT p90", "TPOT p90", "goodput", "probes"):
        t.add_column(h, justify="left" if h == "policy" else "right", overflow="fold")
    for a in answers:
        p = a.probes.get(a.replicas) if a.replicas is not None else None
        t.add_row(label(a), str(a.replicas) if a.replicas is not None else f"> {a.limit}",
                  str(a.gpus) if a.gpus is not None else "–",
                  f"{p.ttft_p90_ms:,.0f} ms" if p else "–", f"{p.tpot_p90_ms:,.1f} ms" if p else "–",
                  f"{p.goodput:.0%}" if p else "–", str(len(a.probes)))
    return t


def saving(answers: list[Answer]) -> str | None:
    """What kv-aware saves over round-robin in the twin, when both were sized."""
    by = {a.policy: a for a in answers if not a.peer}
    rr, kv = by.get("round-robin"), by.get("kv-aware")
    if rr is None or kv is None or kv.replicas is None:
        return None
    if rr.replicas is None:
        return f"kv-aware meets the SLO with {kv.replicas} replicas; round-robin does not with {rr.limit}"
    n = rr.replicas - kv.replicas
    gpus = f" ({n * kv.gpus_per_replica} GPUs)" if kv.gpus_per_replica else ""
    return f"kv-aware needs {n} fewer replicas{gpus} than round-robin ({kv.replicas} against {rr.replicas})"


def dynamo_answer(answers: list[Answer]) -> str | None:
    """Dynamo's KV router's answer from its own replay (and its saving over Dynamo's round-robin)."""
    by = {a.policy: a for a in answers if a.peer}
    kv, rr = by.get("dynamo-kv-router"), by.get("dynamo-round-robin")
    if kv is None:
        return None
    head = "Dynamo's own replay (its router and mocker, its timing model, not kvlab's twin): dynamo-kv-router "
    if kv.replicas is None:
        return head + f"does not meet the SLO with {kv.limit} replicas"
    gpus = f" ({kv.gpus} GPUs)" if kv.gpus_per_replica else ""
    line = head + f"needs {kv.replicas} replicas{gpus}"
    if rr is not None:
        line += (f", dynamo-round-robin {rr.replicas}" if rr.replicas is not None
                 else f"; dynamo-round-robin does not meet it with {rr.limit}")
    return line


def figure(answers: list[Answer], slo: Target) -> go.Figure:
    """Goodput against replicas, one line per policy, each policy's answer marked."""
    fig = go.Figure()
    for a in answers:
        xs = sorted(a.probes)
        name = f"{a.policy} (Dynamo's simulator)" if a.peer else a.policy
        fig.add_scatter(x=xs, y=[a.probes[n].goodput for n in xs], name=name, mode="lines+markers",
                        line={"dash": "dot" if a.peer else "solid"})
        if a.replicas is not None:
            fig.add_scatter(x=[a.replicas], y=[a.probes[a.replicas].goodput], name=f"{name}: {a.replicas}",
                            mode="markers", marker={"size": 14, "symbol": "star"})
    if slo.goodput_share is not None:
        fig.add_hline(y=slo.goodput_share, line_dash="dash", annotation_text="SLO goodput")
    twin = "twin; dotted: Dynamo's replay" if any(a.peer for a in answers) else "twin"
    fig.update_layout(title=f"Goodput against replicas ({twin}) · SLO {slo.describe()}",
                      xaxis={"title": "replicas", "type": "log"},
                      yaxis={"title": "requests meeting TTFT and TPOT bounds", "tickformat": ".0%"})
    return fig


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        settings, slo = settings_of(args)
        policies = policies_of(args.policies)
        jobs = jobs_of(args.jobs)
        names, replays = dynamo.split(policies)
        first = resolve(msgspec.structs.replace(settings, policy=names[0] if names else None, replicas=args.start))
        for p in names[1:]:
            resolve(msgspec.structs.replace(settings, policy=p, replicas=args.start))
        if replays:
            dynamo.check(first)
    except ConfigError as exc:
        fail(console, "plan", exc)
        return 2
    gpus = first.profile.gpus_per_replica
    console.print(f"plan · {first.workload.name} · {settings.requests} requests a probe · profile {first.profile_name} "
                  f"({gpus} GPU{'' if gpus == 1 else 's'} a replica) · SLO {slo.describe()} · {SOURCE}",
                  highlight=False)
    if first.profile_reason:
        console.print(f"profile {first.profile_name}: {first.profile_reason}", highlight=False)
    if first.fit is not None and (note := describe(first.fit, first.profile_name)):
        console.print(note, highlight=False)
    if replays:
        console.print(f"{', '.join(replays)}: {dynamo.source()}, engines sized as the twin's replicas",
                      highlight=False)
    start = time.perf_counter()
    try:
        found = _search(names, settings, slo, args, jobs, console)
        for name in replays:   # seconds each, in this process (Dynamo's runtime is never forked)
            def report(p: Probe, name: str = name) -> None:
                console.print(probe_line(f"{name} (peer)", p), highlight=False)

            found[name] = dynamo_replicas_needed(settings, slo, name, args.max_replicas, args.start, report)
    except (Stopped, TwinError, ConfigError) as exc:
        fail(console, "plan", exc)
        return 2 if isinstance(exc, ConfigError) else 1
    answers = [found[p] for p in policies]
    wall = time.perf_counter() - start
    console.print(answer_table(answers, slo))
    for line in (saving(answers), dynamo_answer(answers)):
        if line is not None:
            console.print(line, highlight=False)
    run_dir = _run_dir(args.run_dir)
    doc = {"source": SOURCE, "command": "kvlab plan " + " ".join(argv), "settings": msgspec.to_builtins(settings),
           "profile": first.profile_name, "gpus_per_replica": first.profile.gpus_per_replica,
           "slo": msgspec.to_builtins(slo), "wall_s": round(wall, 1), "saving": saving(answers),
           "answers": {a.policy: {"replicas": a.replicas, "gpus": a.gpus, "limit": a.limit, "source": a.source,
                                  "peer": a.peer, "probes": [msgspec.to_builtins(p) for p in a.probes.values()]}
                       for a in answers}}
    if replays:
        doc["dynamo"] = {"source": dynamo.source(), "engine": dynamo.engine_args(first),
                         "answer": dynamo_answer(answers)}
    # strict JSON: a percentile among the errors (infinite) is null
    (run_dir / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc, enc_hook=str), indent=2) + b"\n")
    figure(answers, slo).write_html(run_dir / "plan.html", include_plotlyjs="cdn")
    source = "the twin; the (peer) rows from Dynamo's replay" if replays else "the twin"
    console.print(f"[green]wrote[/green] {run_dir / 'plan.html'} and plan.json ({wall:.0f} s; figures from {source})")
    return 0


def _search(names: list[str], settings: TwinSettings, slo: Target, args: argparse.Namespace, jobs: int,
            console: Console) -> dict[str, Answer]:
    """Each of kvlab's policies' searches, side by side (twin/workers.py), each probe printed as it
    is judged; a TwinError when a signal stopped them."""
    def search(policy: str, report: Report) -> Answer:
        return replicas_needed(settings, slo, policy, args.max_replicas, args.start, report)

    def printed(i: int, p: Probe) -> None:
        console.print(probe_line(names[i], p), highlight=False)

    ended = side_by_side(names, search, printed, jobs)
    early = ended.cut_short(lambda i: f"{names[i]} search")
    if early is not None:
        raise TwinError(early[0])
    return {names[i]: answer for i, answer in ended.values.items()}


def _run_dir(arg: str | None) -> Path:
    from kvlab.stack.state import new_run_dir

    run_dir = Path(arg) if arg else new_run_dir("plan")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
