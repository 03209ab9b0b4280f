"""Calibrate the simulator's `cpu-tiny` profile against real vLLM on CPU, and compare them.

    .venv/bin/python benchmarks/calibrate.py [--reps 3] [--write-profile] [--out runs/calibration]

1. starts one real vLLM replica of kvlab's tiny model (`kvlab engine vllm`, pinned to one core:
   what each replica gets in the 2-replica lab on 2 cores);
2. measures TTFT against prompt length x cached fraction, and inter-token latency against batch
   size (fit pass);
3. fits the profile's step-time numbers (see kvlab/engine/sim/profile.py for the formula):
   step_overhead_ms + prefill_ms_per_token by minimising the worst relative TTFT error over the
   grid, decode_ms_base + decode_ms_per_seq by least squares on ITL;
4. starts `kvlab engine sim` with the fitted profile and measures both again, interleaved point
   by point (compare pass; the machine is shared, so medians of --reps repeats are reported);
5. writes results.json, a markdown table and a plotly figure (HTML, plus PNG via headless
   Chromium when present) to --out, and with --write-profile updates the `cpu-tiny` entry of the
   shipped profiles.yaml (only its four step-time numbers).

TTFT is the time to the first streamed chunk carrying a choice (kvlab's tokenizer makes every id
visible text, so it is also the first non-empty token). Prompts are random token ids; the cached
part is primed by a request for exactly that prefix, then verified against `cached_tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvlab.engine.sim.profile import default_path, get_profile
from kvlab.tokenizer import Tokenizer

MODEL = "kvlab-tiny"
BS = 128
FIT_KEYS = ("step_overhead_ms", "prefill_ms_per_token", "decode_ms_base", "decode_ms_per_seq")
KVLAB = [sys.executable, "-m", "kvlab.cli"]


# ---- engines --------------------------------------------------------------------------------
def start_engine(argv: list[str], log: Path, timeout: float) -> tuple[subprocess.Popen, dict]:
    """Start `kvlab engine ...` and return it with its ready JSON."""
    ready = log.with_suffix(".ready.json")
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen([*argv, "--ready-file", str(ready)], stdout=subprocess.DEVNULL,
                            stderr=open(log, "ab"), start_new_session=True)  # noqa: SIM115
    deadline = time.monotonic() + timeout
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            sys.exit(f"calibrate: {argv[3:5]} did not start; see {log}")
        time.sleep(0.5)
    return proc, json.loads(ready.read_text())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ---- measurements ---------------------------------------------------------------------------
async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: TTFT, the chunk times, and usage."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices"):
                times.append(time.perf_counter() - t0)
            if d.get("usage"):
                usage = d["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_ms": times[0] * 1000, "times": times, "cached": cached}


async def ttft_point(client, url: str, n: int, cached: int, rng: random.Random, visible: list[int]) -> dict:
    prompt = [rng.choice(visible) for _ in range(n)]
    if cached:
        await stream(client, url, prompt[:cached], 1)          # prime exactly `cached` tokens
    res = await stream(client, url, prompt, 1)
    if res["cached"] != cached:
        print(f"  warning: {url} n={n}: cached {res['cached']} != primed {cached}", file=sys.stderr)
    return {"n": n, "cached": res["cached"], "ttft_ms": res["ttft_ms"]}


async def itl_point(client, url: str, batch: int, rng: random.Random, visible: list[int],
                    prompt_len: int = 64, out_len: int = 48) -> dict:
    """Median over the batch's requests of (last token - first token) / (tokens - 1): SSE chunks may
    carry several tokens when the client lags, so tokens are counted, not chunks."""
    prompts = [[rng.choice(visible) for _ in range(prompt_len)] for _ in range(batch)]
    results = await asyncio.gather(*(stream(client, url, p, out_len) for p in prompts))
    itls = [(r["times"][-1] - r["times"][0]) * 1000 / (out_len - 1) for r in results]
    return {"batch": batch, "itl_ms": statistics.median(itls)}


def cached_tokens(n: int, fraction: float) -> int:
    """The block-aligned cached prefix for a fraction (vLLM caches whole blocks, never the last token)."""
    return min(int(n * fraction) // BS * BS, (n - 1) // BS * BS)


async def measure(targets: dict[str, str], lengths, fractions, batches, reps: int, seed: int,
                  label: str) -> dict:
    """Every grid point for every target, interleaved (targets alternate order per repeat)."""
    visible = Tokenizer().visible_ids
    rng = random.Random(seed)
    out: dict = {name: {"ttft": [], "itl": []} for name in targets}
    names = list(targets)
    async with httpx.AsyncClient(timeout=300) as client:
        for rep in range(reps):
            order = names if rep % 2 == 0 else names[::-1]
            for n in lengths:
                for f in fractions:
                    for name in order:
                        p = await ttft_point(client, targets[name], n, cached_tokens(n, f), rng, visible)
                        out[name]["ttft"].append({**p, "fraction": f, "rep": rep})
                print(f"  [{label} rep {rep + 1}/{reps}] n={n}: "
                      + ", ".join(f"{nm} {out[nm]['ttft'][-1]['ttft_ms']:.0f} ms" for nm in names),
                      file=sys.stderr)
            for b in batches:
                for name in order:
                    p = await itl_point(client, targets[name], b, rng, visible)
                    out[name]["itl"].append({**p, "rep": rep})
    return out


def medians(rows: list[dict], key: tuple[str, ...], value: str) -> dict[tuple, float]:
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r[value])
    return {k: statistics.median(v) for k, v in groups.items()}


def spread(rows: list[dict], key: tuple[str, ...], value: str) -> float:
    """Median over points of (max - min) / median across repeats: how noisy the machine was."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r[value])
    rel = [(max(v) - min(v)) / statistics.median(v) for v in groups.values() if len(v) > 1]
    return statistics.median(rel) if rel else 0.0


# ---- fit -------------------------------------------------------------------------------------
def steps(todo: int, max_batched: int) -> int:
    return max(1, -(-todo // max_batched))


def fit(ttft: dict[tuple, float], itl: dict[tuple, float], max_batched: int) -> dict[str, float]:
    """The profile's four step-time numbers (formula in sim/profile.py), minimising the worst relative
    error over TTFT *and* ITL together: step_overhead_ms is paid by every prefill and decode step."""
    bs = sorted(b for (b,) in itl)
    best = None
    for over in [x * 0.5 for x in range(0, 101)]:                 # 0 .. 50 ms
        ys = [itl[(b,)] - over for b in bs]                        # decode_ms_base + B * per_seq
        mx, my = statistics.fmean(bs), statistics.fmean(ys)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(bs, ys))
                    / max(1e-9, sum((x - mx) ** 2 for x in bs)))
        base = max(0.0, my - slope * mx)
        itl_err = max(abs(over + base + b * slope - itl[(b,)]) / itl[(b,)] for b in bs)
        for per in [x * 0.005 for x in range(1, 401)]:            # 0.005 .. 2 ms/token
            err = max(itl_err, max(abs(steps(n - c, max_batched) * over + (n - c) * per - y) / y
                                   for (n, c), y in ttft.items()))
            if best is None or err < best[0]:
                best = (err, over, per, base, slope)
    _, over, per, base, slope = best
    return {"step_overhead_ms": round(over, 2), "prefill_ms_per_token": round(per, 4),
            "decode_ms_base": round(base, 2), "decode_ms_per_seq": round(slope, 3)}


def fit_extended(ttft: dict[tuple, float], itl: dict[tuple, float], max_batched: int) -> dict[str, float]:
    """A proposal for the simulator (not a profile field yet): the same formula plus a fixed
    per-request cost and an attention term, each computed prompt token at position p costing
    `prefill_ms_per_token + prefill_ms_per_token_per_1k_ctx * p / 1000`. Relative least squares."""
    import numpy as np

    bs = sorted(b for (b,) in itl)
    slope, icept = np.polyfit(bs, [itl[(b,)] for b in bs], 1)
    over = max(0.0, float(icept))                                  # decode_ms_base 0: all in the step
    rows, ys = [], []
    for (n, c), y in ttft.items():
        todo = n - c
        ctx = (c + n - 1) * todo / 2 / 1000                        # sum of positions, in thousands
        rows.append([1.0, todo, ctx])
        ys.append(y - steps(todo, max_batched) * over)
    a = np.array(rows) / np.array([[y] for y in ttft.values()])
    b = np.array(ys) / np.array(list(ttft.values()))
    (req, per, per_ctx), *_ = np.linalg.lstsq(a, b, rcond=None)
    return {"request_overhead_ms": round(max(0.0, float(req)), 2), "step_overhead_ms": round(over, 2),
            "prefill_ms_per_token": round(float(per), 4), "prefill_ms_per_token_per_1k_ctx": round(float(per_ctx), 4),
            "decode_ms_base": 0.0, "decode_ms_per_seq": round(max(0.0, float(slope)), 3)}


def predict_extended(p: dict[str, float], n: int, c: int, max_batched: int) -> float:
    todo = n - c
    return (p["request_overhead_ms"] + steps(todo, max_batched) * p["step_overhead_ms"]
            + todo * p["prefill_ms_per_token"] + p["prefill_ms_per_token_per_1k_ctx"] * (c + n - 1) * todo / 2000)


def write_profile(path: Path, values: dict[str, float]) -> None:
    """Replace the four step-time numbers of the `cpu-tiny` entry, keeping everything else."""
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, l in enumerate(lines) if l.rstrip() == "  cpu-tiny:")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^  \S", lines[i])), len(lines))
    for i in range(start, end):
        m = re.match(r"^(    )(\w+)(:\s*)([-\d.eE]+)(.*)$", lines[i].rstrip("\n"))
        if m and m.group(2) in values:
            lines[i] = f"{m.group(1)}{m.group(2)}{m.group(3)}{values[m.group(2)]}{m.group(5)}\n"
    path.write_text("".join(lines))


# ---- report ----------------------------------------------------------------------------------
def report(result: dict, out: Path) -> str:
    real_t = medians(result["compare"]["vllm"]["ttft"], ("n", "fraction"), "ttft_ms")
    sim_t = medians(result["compare"]["sim"]["ttft"], ("n", "fraction"), "ttft_ms")
    real_i = medians(result["compare"]["vllm"]["itl"], ("batch",), "itl_ms")
    sim_i = medians(result["compare"]["sim"]["itl"], ("batch",), "itl_ms")
    ext = result.get("extended")
    rows = ["| prompt tokens | cached | vLLM TTFT ms | sim TTFT ms | error |"
            + (" extended model ms | error |" if ext else ""),
            "|---:|---:|---:|---:|---:|" + ("---:|---:|" if ext else "")]
    errs, ext_errs = [], []
    for (n, f), y in sorted(real_t.items()):
        e = (sim_t[(n, f)] - y) / y
        errs.append(e)
        row = f"| {n} | {cached_tokens(n, f)} ({f:.0%}) | {y:.0f} | {sim_t[(n, f)]:.0f} | {e:+.0%} |"
        if ext:
            x = predict_extended(ext, n, cached_tokens(n, f), 2048)
            ext_errs.append((x - y) / y)
            row += f" {x:.0f} | {ext_errs[-1]:+.0%} |"
        rows.append(row)
    rows += ["", "| batch | vLLM ITL ms | sim ITL ms | error |", "|---:|---:|---:|---:|"]
    for (b,), y in sorted(real_i.items()):
        rows.append(f"| {b} | {y:.1f} | {sim_i[(b,)]:.1f} | {(sim_i[(b,)] - y) / y:+.0%} |")
    within = sum(abs(e) <= 0.25 for e in errs)
    summary = (f"TTFT: {within}/{len(errs)} grid points within ±25 %, worst {max(errs, key=abs):+.0%}, "
               f"median |error| {statistics.median(abs(e) for e in errs):.0%}; "
               f"noise (median (max-min)/median over repeats): vLLM TTFT "
               f"{spread(result['compare']['vllm']['ttft'], ('n', 'fraction'), 'ttft_ms'):.0%}, "
               f"ITL {spread(result['compare']['vllm']['itl'], ('batch',), 'itl_ms'):.0%}")
    if ext_errs:
        summary += (f"\nextended model (computed, not simulated): {sum(abs(e) <= 0.25 for e in ext_errs)}/"
                    f"{len(ext_errs)} within ±25 %, worst {max(ext_errs, key=abs):+.0%}")
    table = "\n".join(rows) + "\n\n" + summary + "\n"
    (out / "calibration.md").write_text(table)
    figure(real_t, sim_t, real_i, sim_i, out)
    return table


def figure(real_t, sim_t, real_i, sim_i, out: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT vs prompt length (by cached fraction)",
                                                        "inter-token latency vs batch size"))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    fractions = sorted({f for _, f in real_t})
    for i, f in enumerate(fractions):
        xs = sorted(n for n, ff in real_t if ff == f)
        c = colors[i % len(colors)]
        fig.add_trace(go.Scatter(x=xs, y=[real_t[(n, f)] for n in xs], name=f"vLLM, {f:.0%} cached",
                                 mode="lines+markers", line={"color": c}), 1, 1)
        fig.add_trace(go.Scatter(x=xs, y=[sim_t[(n, f)] for n in xs], name=f"sim, {f:.0%} cached",
                                 mode="lines+markers", line={"color": c, "dash": "dash"},
                                 marker={"symbol": "x"}), 1, 1)
    bs = sorted(b for (b,) in real_i)
    fig.add_trace(go.Scatter(x=bs, y=[real_i[(b,)] for b in bs], name="vLLM ITL", mode="lines+markers",
                             line={"color": "black"}), 1, 2)
    fig.add_trace(go.Scatter(x=bs, y=[sim_i[(b,)] for b in bs], name="sim ITL", mode="lines+markers",
                             line={"color": "black", "dash": "dash"}, marker={"symbol": "x"}), 1, 2)
    fig.update_xaxes(title_text="prompt tokens", type="log", row=1, col=1)
    fig.update_yaxes(title_text="TTFT ms", type="log", row=1, col=1)
    fig.update_xaxes(title_text="concurrent decoding requests", row=1, col=2)
    fig.update_yaxes(title_text="ITL ms (median)", row=1, col=2)
    fig.update_layout(title="kvlab's tiny model: real vLLM (CPU, 1 core) vs the calibrated simulator",
                      width=1200, height=520, template="plotly_white")
    html = out / "calibration.html"
    fig.write_html(html, include_plotlyjs=True, config={"displayModeBar": False})   # self-contained, offline
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                        f"--screenshot={out / 'calibration.png'}", "--window-size=1220,540", html.as_uri()],
                       capture_output=True, timeout=120)


# ---- main ------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,512,1024,2048,4096")
    p.add_argument("--fractions", default="0,0.5,0.9")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=3, help="repeats per point (medians are reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", default="0", help="CPU set of the vLLM replica (kvlab engine vllm --cpus)")
    p.add_argument("--out", default="runs/calibration", help="results directory")
    p.add_argument("--write-profile", action="store_true", help="update cpu-tiny in the shipped profiles.yaml")
    p.add_argument("--no-fit", action="store_true", help="compare with the current cpu-tiny profile as is")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    fractions = [float(x) for x in a.fractions.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    max_len = max(lengths) + 256
    common = ["--max-model-len", str(max_len), "--max-num-seqs", "128", "--max-num-batched-tokens", "2048"]
    t0 = time.monotonic()
    vllm, ready = start_engine([*KVLAB, "engine", "vllm", "--name", "cal", "--cpus", a.cpus, "--no-kv-events",
                                *common, "--log-dir", str(out / "logs")], out / "vllm.log", 900)
    real = ready["replicas"][0]["url"]
    print(f"vLLM ready in {time.monotonic() - t0:.0f} s at {real}", file=sys.stderr)
    sim = None
    try:
        result: dict = {"grid": {"lengths": lengths, "fractions": fractions, "batches": batches, "reps": a.reps}}
        profiles = out / "profiles.yaml"
        shutil.copy(default_path(), profiles)
        if not a.no_fit:
            fitm = asyncio.run(measure({"vllm": real}, lengths, fractions, batches, a.reps, a.seed, "fit"))
            ttft = medians([{**r, "c": r["cached"]} for r in fitm["vllm"]["ttft"]], ("n", "c"), "ttft_ms")
            itl = medians(fitm["vllm"]["itl"], ("batch",), "itl_ms")
            values = fit(ttft, itl, 2048)
            result["fit_pass"] = fitm
            result["fitted"] = values
            result["extended"] = fit_extended(ttft, itl, 2048)
            print(f"extended-model proposal: {result['extended']}", file=sys.stderr)
            print(f"fitted cpu-tiny: {values}", file=sys.stderr)
            write_profile(profiles, values)
        result["profile"] = {k: getattr(get_profile("cpu-tiny", profiles), k) for k in FIT_KEYS}
        sim, sready = start_engine([*KVLAB, "engine", "sim", "--name", "calsim", "--profile", "cpu-tiny",
                                    "--profiles-file", str(profiles), "--block-size", str(BS), "--no-kv-events",
                                    "--num-blocks", "1024", *common], out / "sim.log", 120)
        result["compare"] = asyncio.run(measure({"vllm": real, "sim": sready["replicas"][0]["url"]}, lengths,
                                                fractions, batches, a.reps, a.seed + 1, "compare"))
        (out / "results.json").write_text(json.dumps(result, indent=1))
        print(report(result, out))
        print(f"profile: {result['profile']}\nresults in {out}/ (results.json, calibration.md, "
              f"calibration.html/.png); took {time.monotonic() - t0:.0f} s")
        if a.write_profile and not a.no_fit:
            write_profile(default_path(), result["fitted"])
            print(f"updated cpu-tiny in {default_path()}")
    finally:
        if sim is not None:
            stop(sim)
        stop(vllm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
