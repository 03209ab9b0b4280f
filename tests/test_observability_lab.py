"""The observability proof on a real run: `kvlab lab --quick` (sim replicas, gateway under both
policies, Locust traffic, the OTLP sink, a real Prometheus), then

- every panel query of every dashboard, evaluated against that Prometheus's data the way Grafana
  would, errors on none and returns series with finite values (only the queries of metrics that
  open issues add are exempt: kvlab.dashboards.catalog.PENDING_METRICS);
- the sink's spans of one request from client, gateway and replica share one trace id;
- `kvlab traces explain` prints candidates, scores, chosen replica and the three hit-rate numbers;
- the HTML views render in headless Chromium.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, require, require_binary
from kvlab.dashboards.verify import query_range, verify
from kvlab.telemetry import names as n
from kvlab.traces.decision import decision_of
from kvlab.traces.sources.otlp_files import OtlpFileSource

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> tuple[Path, float, float]:
    require_binary("prometheus")
    run = tmp_path_factory.mktemp("obs") / "run"
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "lab", "--quick", "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=200)
    end = time.time()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stack = json.loads((run / "stack.json").read_text())
    assert stack["prometheus"] and stack["traces_dir"], "the lab ran without Prometheus or the trace sink"
    return run, start, end


@pytest.fixture(scope="module")
def prometheus(lab, tmp_path_factory):
    """A Prometheus serving the TSDB the lab's Prometheus wrote while it scraped the run."""
    from kvlab.stack.prometheus import start_prometheus

    run, _, _ = lab
    home = tmp_path_factory.mktemp("prom-replay")
    shutil.copytree(run / "prometheus" / "data", home / "prometheus" / "data")
    port = free_port()
    proc = start_prometheus(home, {}, port)
    require(proc is not None, "the prometheus binary")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def test_every_dashboard_query_returns_data(lab, prometheus):
    run, start, end = lab
    # the lab's Prometheus scraped both jobs, and they were up
    up = query_range(prometheus, "max_over_time(up[10s])", start, end, 2)
    jobs = {(s["metric"]["job"], s["metric"]["instance"]) for s in up if any(v == "1" for _, v in s["values"])}
    assert {j for j, _ in jobs} == {"gateway", "replicas"}
    assert len([i for j, i in jobs if j == "replicas"]) == len(json.loads((run / "endpoints.json").read_text())["replicas"])
    # the checks can fail: a misspelt metric has no series, bad PromQL is an error
    assert query_range(prometheus, f"{n.KVLAB_REQUESTS}_totl", start, end, 2) == []
    with pytest.raises(ValueError):
        query_range(prometheus, "sum by (policy (x)", start, end, 2)

    results = verify(prometheus, start, end)
    failures = [f"{r.uid} / {r.panel} / {r.ref}: {r.problem}\n    {r.expr}" for r in results if not r.ok]
    assert not failures, "panels without data:\n" + "\n".join(failures)
    pending = [r for r in results if r.pending]
    assert pending and all(r.uid == "kvlab-pd-dp" for r in pending)
    landed = [f"{r.panel} ({r.pending})" for r in pending if r.series]
    if landed:
        print("pending dashboard queries that now return data (drop them from PENDING):", landed)
    # both phases are on the before/after panels
    policies = {s["metric"]["policy"] for s in query_range(
        prometheus, f"sum by (policy) ({n.KVLAB_REQUESTS}_total)", start, end, 2)}
    assert policies == {"round-robin", "kv-aware"}


def test_one_trace_id_from_client_to_replica(lab):
    run, _, _ = lab
    traces = OtlpFileSource(run / "traces").traces()
    full = [t for t in traces if t.first(n.SPAN_GATEWAY_REQUEST) and t.first(n.SPAN_ENGINE_REQUEST)]
    assert len(full) >= 0.9 * len([t for t in traces if t.first(n.SPAN_GATEWAY_REQUEST)]) > 50
    t = full[-1]
    gateway, engine = t.first(n.SPAN_GATEWAY_REQUEST), t.first(n.SPAN_ENGINE_REQUEST)
    assert gateway.service != engine.service
    # the replica's span hangs under the gateway's upstream call, which hangs under the request
    upstream = next(s for s in t if s.span_id == engine.parent_id)
    assert upstream.name == n.SPAN_UPSTREAM and upstream.parent_id == gateway.span_id
    d = decision_of(t)
    assert d.chosen == engine.attr(n.REPLICA) and d.candidates and d.prompt_tokens


def test_traces_explain_on_the_run(lab, tmp_path: Path):
    run, _, _ = lab
    html = tmp_path / "explain.html"
    out = subprocess.run([sys.executable, "-m", "kvlab.cli", "traces", "explain", "--run", str(run), "--html", str(html)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    replicas = [r["name"] for r in json.loads((run / "endpoints.json").read_text())["replicas"]]
    assert all(r in text for r in replicas) and "★" in text
    for label in ("prefix ×", "queue ×", "total", "cached prefix", "available (any replica)",
                  "predicted (chosen replica)", "delivered (engine reused)", "client TTFT", "round-robin", "kv-aware"):
        assert label in text, label
    assert html.stat().st_size > 1_000_000   # plotly.js embedded: opens offline


@pytest.mark.browser
def test_trace_views_render_in_chromium(lab, tmp_path: Path):
    from PIL import Image

    from kvlab.traces.figures import decision_figure, waterfall_figure, write_html
    from kvlab.traces.screenshot import chromium, screenshot

    require(chromium() is not None, "the chromium binary")
    run, _, _ = lab
    trace = [t for t in OtlpFileSource(run / "traces").traces() if t.first(n.SPAN_SCHEDULE)][-1]
    page = write_html([decision_figure(decision_of(trace)), waterfall_figure(trace)], tmp_path / "views.html")
    png = screenshot(page, tmp_path / "views.png", 1200, 1100)
    image = Image.open(png).convert("RGB").resize((120, 110))
    colours = {image.getpixel((x, y)) for x in range(120) for y in range(110)}
    assert len(colours) > 50, "the page rendered (nearly) blank"
