"""`kvlab calibrate`: fit a simulator profile to this machine's vLLM and show how close it gets.

1. starts one real vLLM replica of kvlab's tiny model (`kvlab engine vllm`, one core: what each
   replica gets in the 2-replica lab on 2 cores; dtype as `kvlab doctor` chooses);
2. fit pass: TTFT by prompt length x cached fraction, ITL by batch size (kvlab.calibration.measure);
3. fits the profile (kvlab.calibration.fit) and writes it as a user profile, $KVLAB_HOME/profiles/
   NAME.yaml, which `kvlab engine sim --profile NAME` and topologies' `sim.profile` find by name;
4. compare pass: `kvlab engine sim` with that profile and vLLM measured again on the same grid,
   interleaved point by point; prints the error per grid point and writes results.json,
   calibration.md and calibration.html (plotly) to the run dir.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvlab.calibration.fit import fit
from kvlab.calibration.measure import Grid, medians, spread, start_engine
from kvlab.doctor import DTYPES, detect_isa
from kvlab.engine.model import resolve_dtype
from kvlab.engine.sim.profile import LatencyProfile, write_user_profile
from kvlab.lifecycle import terminate
from kvlab.run.command import fail, guarded
from kvlab.stack.state import new_run_dir, write_json

MAX_BATCHED = 2048     # vLLM's CPU default max_num_batched_tokens; the sim gets the same
QUICK = {"lengths": "256,512,1024,2048,4096", "fractions": "0,0.5,0.9", "batches": "1,2,4,8,16", "reps": 3}
FULL = {"lengths": "256,512,1024,2048,4096", "fractions": "0,0.5,0.9", "batches": "1,2,4,8,16", "reps": 5}
TOLERANCE = 0.25


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['reps']} repeats instead of {FULL['reps']} (~2-5 min on 2 cores)")
    p.add_argument("--name", default="local", help="the profile's name (written to $KVLAB_HOME/profiles/NAME.yaml)")
    p.add_argument("--lengths", help=f"prompt lengths (default {FULL['lengths']})")
    p.add_argument("--fractions", help=f"cached fractions (default {FULL['fractions']})")
    p.add_argument("--batches", help=f"decode batch sizes (default {FULL['batches']}; quick {QUICK['batches']})")
    p.add_argument("--reps", type=int, help=f"repeats per point, medians reported (default {FULL['reps']})")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the tiny model's dtype (auto: as `kvlab doctor` chooses)")
    p.add_argument("--cpus", default="0", help="CPU set of the vLLM replica (kvlab engine vllm --cpus)")
    p.add_argument("--seed", type=int, default=0, help="seed of the measured prompts (default 0)")
    p.add_argument("--run-dir", help="where to write results (default: a new runs/<id>-calibrate)")
    return p


def _grid(a: argparse.Namespace) -> tuple[Grid, int]:
    preset = QUICK if a.quick else FULL
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x.strip()]

    grid = Grid(ints(a.lengths or str(preset["lengths"])),
                [float(x) for x in str(a.fractions or preset["fractions"]).split(",") if x.strip()],
                ints(a.batches or str(preset["batches"])))
    return grid, a.reps or int(str(preset["reps"]))


def _measure(console: Console, grid: Grid, targets: dict[str, str], reps: int, seed: int,
             label: str) -> dict[str, Any]:
    with Progress(TextColumn(f"{label:<8}"), BarColumn(bar_width=30), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[now]}"), console=console) as progress:
        task = progress.add_task(label, total=grid.size() * reps, now="")
        return asyncio.run(grid.measure(targets, reps, seed, lambda now: progress.update(task, advance=1, now=now)))


def compare(grid: Grid, result: dict[str, Any]) -> dict[str, Any]:
    """Per grid point: vLLM's and the simulator's medians and the relative error."""
    real_t = medians(result["compare"]["vllm"]["ttft"], ("n", "fraction"), "ttft_ms")
    sim_t = medians(result["compare"]["sim"]["ttft"], ("n", "fraction"), "ttft_ms")
    real_i = medians(result["compare"]["vllm"]["itl"], ("batch",), "itl_ms")
    sim_i = medians(result["compare"]["sim"]["itl"], ("batch",), "itl_ms")
    cached = {(r["n"], r["fraction"]): r["primed"] for r in result["compare"]["vllm"]["ttft"]}
    ttft = [{"n": n, "fraction": f, "cached": cached[(n, f)], "vllm_ms": round(y, 1),
             "sim_ms": round(sim_t[(n, f)], 1), "error": round((sim_t[(n, f)] - y) / y, 3)}
            for (n, f), y in sorted(real_t.items())]
    itl = [{"batch": b, "vllm_ms": round(y, 2), "sim_ms": round(sim_i[(b,)], 2),
            "error": round((sim_i[(b,)] - y) / y, 3)} for (b,), y in sorted(real_i.items())]
    errs = [p["error"] for p in ttft]
    return {"ttft": ttft, "itl": itl, "ttft_within": sum(abs(e) <= TOLERANCE for e in errs),
            "ttft_points": len(errs), "ttft_worst": max(errs, key=abs),
            "ttft_median_abs": round(statistics.median(abs(e) for e in errs), 3),
            "itl_within": sum(abs(p["error"]) <= TOLERANCE for p in itl),
            "noise_ttft": round(spread(result["compare"]["vllm"]["ttft"], ("n", "fraction"), "ttft_ms"), 3),
            "noise_itl": round(spread(result["compare"]["vllm"]["itl"], ("batch",), "itl_ms"), 3)}


def markdown(c: dict[str, Any]) -> str:
    rows = ["| prompt tokens | cached | vLLM TTFT ms | sim TTFT ms | error |", "|---:|---:|---:|---:|---:|"]
    rows += [f"| {p['n']} | {p['cached']} ({p['fraction']:.0%}) | {p['vllm_ms']:.0f} | {p['sim_ms']:.0f} | "
             f"{p['error']:+.0%} |" for p in c["ttft"]]
    rows += ["", "| batch | vLLM ITL ms | sim ITL ms | error |", "|---:|---:|---:|---:|"]
    rows += [f"| {p['batch']} | {p['vllm_ms']:.1f} | {p['sim_ms']:.1f} | {p['error']:+.0%} |" for p in c["itl"]]
    rows += ["", f"TTFT: {c['ttft_within']}/{c['ttft_points']} points within ±{TOLERANCE:.0%} (worst "
             f"{c['ttft_worst']:+.0%}, median |error| {c['ttft_median_abs']:.0%}); ITL: {c['itl_within']}/"
             f"{len(c['itl'])}; noise, median (max-min)/median over repeats: vLLM TTFT {c['noise_ttft']:.0%}, "
             f"ITL {c['noise_itl']:.0%}"]
    return "\n".join(rows) + "\n"


def rich_table(c: dict[str, Any]) -> Table:
    t = Table("prompt", "cached", "vLLM TTFT ms", "sim TTFT ms", "error", title="simulator vs vLLM, per grid point")
    for p in c["ttft"]:
        style = "green" if abs(p["error"]) <= TOLERANCE else "red"
        t.add_row(str(p["n"]), f"{p['cached']} ({p['fraction']:.0%})", f"{p['vllm_ms']:.0f}", f"{p['sim_ms']:.0f}",
                  f"[{style}]{p['error']:+.0%}[/{style}]")
    for p in c["itl"]:
        style = "green" if abs(p["error"]) <= TOLERANCE else "red"
        t.add_row(f"ITL, batch {p['batch']}", "", f"{p['vllm_ms']:.1f}", f"{p['sim_ms']:.1f}",
                  f"[{style}]{p['error']:+.0%}[/{style}]")
    return t


def figure(c: dict[str, Any], path: Path, title: str) -> Path:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT vs prompt length (by cached fraction)",
                                                        "inter-token latency vs batch size"))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for i, f in enumerate(sorted({p["fraction"] for p in c["ttft"]})):
        pts = [p for p in c["ttft"] if p["fraction"] == f]
        line = {"color": colors[i % len(colors)]}
        fig.add_trace(go.Scatter(x=[p["n"] for p in pts], y=[p["vllm_ms"] for p in pts], name=f"vLLM, {f:.0%} cached",
                                 mode="lines+markers", line=line), 1, 1)
        fig.add_trace(go.Scatter(x=[p["n"] for p in pts], y=[p["sim_ms"] for p in pts], name=f"sim, {f:.0%} cached",
                                 mode="lines+markers", line={**line, "dash": "dash"}, marker={"symbol": "x"}), 1, 1)
    bs = [p["batch"] for p in c["itl"]]
    fig.add_trace(go.Scatter(x=bs, y=[p["vllm_ms"] for p in c["itl"]], name="vLLM ITL", mode="lines+markers",
                             line={"color": "black"}), 1, 2)
    fig.add_trace(go.Scatter(x=bs, y=[p["sim_ms"] for p in c["itl"]], name="sim ITL", mode="lines+markers",
                             line={"color": "black", "dash": "dash"}, marker={"symbol": "x"}), 1, 2)
    fig.update_xaxes(title_text="prompt tokens", type="log", row=1, col=1)
    fig.update_yaxes(title_text="TTFT ms", type="log", row=1, col=1)
    fig.update_xaxes(title_text="concurrent decoding requests", row=1, col=2)
    fig.update_yaxes(title_text="ITL ms (median)", row=1, col=2)
    fig.update_layout(title=title, width=1200, height=520, template="plotly_white")
    fig.write_html(path, include_plotlyjs=True, config={"displayModeBar": False})   # self-contained, offline
    return path


def calibrate(a: argparse.Namespace, console: Console) -> dict[str, Any]:
    grid, reps = _grid(a)
    dtype = resolve_dtype(a.dtype)
    run_dir = Path(a.run_dir).absolute() if a.run_dir else new_run_dir("calibrate")
    run_dir.mkdir(parents=True, exist_ok=True)
    common = ["--max-model-len", str(max(grid.lengths) + 256), "--max-num-seqs", "128",
              "--max-num-batched-tokens", str(MAX_BATCHED), "--block-size", str(grid.block_size), "--no-kv-events"]
    t0 = time.monotonic()
    console.print(f"kvlab calibrate → profile {a.name!r}; {grid.size()} points × {reps} repeats, "
                  f"tiny model in {dtype}; results in {run_dir}")
    with console.status("starting vLLM (about a minute on 2 cores)..."):
        vllm, real = start_engine(["vllm", "--name", "cal", "--cpus", a.cpus, "--dtype", dtype, *common,
                                   "--log-dir", str(run_dir / "logs")], run_dir / "vllm.log", 900)
    sim = None
    try:
        console.print(f"vLLM ready in {time.monotonic() - t0:.0f} s")
        fitm = _measure(console, grid, {"vllm": real}, reps, a.seed, "fit")
        ttft = medians([{**r, "c": r["cached"]} for r in fitm["vllm"]["ttft"]], ("n", "c"), "ttft_ms")
        itl = {b: v for (b,), v in medians(fitm["vllm"]["itl"], ("batch",), "itl_ms").items()}
        values: dict[str, Any] = fit(ttft, itl, MAX_BATCHED)   # floats for LatencyProfile's fields
        profile = LatencyProfile(
            description=f"kvlab's tiny model ({dtype}) on real vLLM CPU, one core, fitted by `kvlab calibrate` "
                        f"on {time.strftime('%Y-%m-%d')}",
            source=f"kvlab calibrate, run {run_dir.name}; CPU {detect_isa().level}", **values,
            block_size=grid.block_size, num_blocks=1024, max_num_seqs=128, max_num_batched_tokens=MAX_BATCHED,
            max_model_len=max(grid.lengths) + 256)
        path = write_user_profile(a.name, profile)
        console.print(f"fitted {a.name}: {json.dumps(values)}\nwritten to {path}")
        sim, sim_url = start_engine(["sim", "--name", "calsim", "--profile", a.name, *common], run_dir / "sim.log", 120)
        cmp = _measure(console, grid, {"vllm": real, "sim": sim_url}, reps, a.seed + 1, "compare")
    finally:
        if sim is not None:
            terminate(sim, 30)
        terminate(vllm, 60)
    result = {"name": a.name, "profile_file": str(path), "dtype": dtype, "isa": msgspec.to_builtins(detect_isa()),
              "grid": {"lengths": grid.lengths, "fractions": grid.fractions, "batches": grid.batches, "reps": reps},
              "fitted": values, "fit_pass": fitm, "compare": cmp, "wall_s": round(time.monotonic() - t0, 1)}
    result["errors"] = c = compare(grid, result)
    (run_dir / "calibration.md").write_text(markdown(c))
    figure(c, run_dir / "calibration.html",
           f"kvlab's tiny model ({dtype}): real vLLM (CPU, 1 core) vs profile {a.name}")
    write_json(run_dir / "results.json", result)
    console.print(rich_table(c))
    console.print(markdown(c).splitlines()[-1])
    console.print(f"took {result['wall_s']:.0f} s; results in {run_dir} (results.json, calibration.md, "
                  f"calibration.html); use it: kvlab engine sim --profile {a.name}")
    return result


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    console = Console()
    if importlib.util.find_spec("vllm") is None:
        return fail(console, "calibrate", "needs real vLLM: run `make vllm` (docs/vllm.md)")
    return guarded(console, "calibrate", lambda: calibrate(a, console), "the engines were stopped")

