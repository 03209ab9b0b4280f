"""Regenerates docs/img/open-vs-closed.png: the same simulator overloaded by closed-loop users and
by an open loop, every request's TTFT against the time it was (scheduled to be) sent.

    python scripts/open-vs-closed.py [OUT_DIR]      (from the repository, .venv active; needs chromium)

One simulated replica serving one sequence at a time with its modelled durations x3 (about 2.5
requests/s); 4 closed-loop users, then an open loop at a constant 6 requests/s, 20 s each.
Prints the machine, the phases' TTFT percentiles and the dispatcher's lateness.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import plotly.io as pio
from plotly.offline import get_plotlyjs

from kvlab.lifecycle import terminate
from kvlab.load.arrival import arrival
from kvlab.load.measure import read_records
from kvlab.load.runner import run_bench
from kvlab.load.spec import BenchSpec
from kvlab.report import figures
from kvlab.traces.screenshot import screenshot

PARAMS = {"groups": 2, "system_tokens": 200, "question_tokens": 16, "output_tokens": 8}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ready = out / "ready.json"
    ready.unlink(missing_ok=True)
    print(f"machine: {os.cpu_count()} cores, {time.strftime('%Y-%m-%d', time.gmtime())}")
    sim = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "engine", "sim", "--max-num-seqs", "1",
                            "--time-scale", "3", "--ready-file", str(ready)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
    try:
        while not ready.exists():
            time.sleep(0.1)
        url = json.loads(ready.read_text())["replicas"][0]["url"]
        base = BenchSpec(workload="shared-prefix", params=PARAMS, duration_s=20, seed=1)
        phases = {"closed loop, 4 users": BenchSpec(**{**_fields(base), "users": 4}),
                  "open loop, 6 req/s": BenchSpec(**{**_fields(base), "arrival": arrival(6.0, "constant")})}
        records = {}
        for name, spec in phases.items():
            d = out / name.split(",")[0].replace(" ", "-")
            s = run_bench(url, d, spec, phase=name)
            loop = f", lateness p99 {s.open_loop.lateness_ms.p99:.1f} ms, {s.open_loop.unfinished} unfinished" \
                if s.open_loop else ""
            print(f"{name}: {s.ok} ok, {s.rps:.2f} req/s, TTFT p50 {s.ttft_ms.p50:.0f} ms, p99 {s.ttft_ms.p99:.0f} ms"
                  + loop)
            records[name] = read_records(d / "requests.jsonl")
    finally:
        terminate(sim)
    fig = figures.ttft_by_replica_over_time(records)
    fig.update_layout(title="The same overloaded replica: TTFT of each request against when it was sent "
                            "(simulator, kvlab)")
    page = out / "open-vs-closed.html"
    page.write_text(f"<html><head><script>{get_plotlyjs()}</script></head><body>"
                    f"{pio.to_html(fig, include_plotlyjs=False, full_html=False)}</body></html>")
    png = screenshot(page, Path("docs/img/open-vs-closed.png"), width=1100, height=520)
    print(f"figure: {png}")


def _fields(spec: BenchSpec) -> dict[str, object]:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/open-vs-closed"))
