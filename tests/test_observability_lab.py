"""The observability proof on a real run: `kvlab lab --quick` (sim replicas, gateway under both
policies, Locust traffic, the OTLP sink, a real Prometheus), then

- every panel query of every dashboard, evaluated against that Prometheus's data the way Grafana
  would, errors on none and returns series with finite values (only the queries of metrics that
  open issues add are exempt: kvlab.dashboards.catalog.PENDING_METRICS); the P/D panels against
  a second, short run of the `pd` topology started alongside;
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

from conftest import QUICK_LAB_TIMEOUT_S, QuickLab, free_port, require, require_binary, stop_everything
from kvlab.dashboards.verify import query_range, verify
from kvlab.stack.base import read_info
from kvlab.telemetry import names as n
from kvlab.traces.decision import decision_of
from kvlab.traces.sources.otlp_files import OtlpFileSource

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]


# P/D panels read metrics only a topology with a prefill pool produces: they are proven on a
# second, short run of labs/topologies/pd.yaml (one kv-aware phase: splits and unified decisions),
# started together with the main run so the file's wall time barely grows.
PD_METRICS = (n.KVLAB_PD_DECISIONS, n.KVLAB_KV_TRANSFER_SECONDS)
PD_LAB = ["--topology", "pd", "--workload", "pd-mix", "--policies", "kv-aware", "--duration", "15", "--users", "6"]


@pytest.fixture(scope="module")
def labs(request: pytest.FixtureRequest, tmp_path_factory) -> dict[str, tuple[Path, float, float]]:
    """The session's `kvlab lab --quick` (conftest.quick_lab) and, started before it is asked for
    (so that the two run together when this module comes first), a short run of the `pd` topology."""
    require_binary("prometheus")
    root = tmp_path_factory.mktemp("obs")
    start = time.time()
    console = root / "pd.log"
    with console.open("w") as log:
        pd = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "lab", "--quick", "--run-dir", str(root / "pd"),
                               *PD_LAB], stdout=log, stderr=subprocess.STDOUT)
    out = {}
    try:
        main: QuickLab = request.getfixturevalue("quick_lab")
        assert main.returncode == 0, (main.stdout + main.stderr)[-5000:]
        out["main"] = (Path(main.run_dir), main.started, main.ended)
        pd.wait(timeout=QUICK_LAB_TIMEOUT_S)
        assert pd.returncode == 0, console.read_text()[-5000:]
        out["pd"] = (root / "pd", start, time.time())
    finally:
        if pd.poll() is None:
            pd.terminate()
            pd.wait(30)
            stop_everything(root)
    for run, _, _ in out.values():
        stack = read_info(run)
        assert stack is not None and stack.prometheus and stack.traces_dir, \
            "the lab ran without Prometheus or the trace sink"
    return out


@pytest.fixture(scope="module")
def lab(labs) -> tuple[Path, float, float]:
    return labs["main"]


def _replay(run: Path, tmp_path_factory):
    """A Prometheus serving the TSDB the lab's Prometheus wrote while it scraped the run."""
    from kvlab.stack.prometheus import start_prometheus

    home = tmp_path_factory.mktemp("prom-replay")
    shutil.copytree(run / "prometheus" / "data", home / "prometheus" / "data")
    port = free_port()
    child = start_prometheus(home, {}, port)
    require(child is not None, "the prometheus binary")
    proc = child.popen
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def prometheus(lab, tmp_path_factory):
    yield from _replay(lab[0], tmp_path_factory)


@pytest.fixture(scope="module")
def pd_prometheus(labs, tmp_path_factory):
    yield from _replay(labs["pd"][0], tmp_path_factory)


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

    results = [r for r in verify(prometheus, start, end) if not _reads_pd(r.expr)]   # P/D: test below
    failures = [f"{r.uid} / {r.panel} / {r.ref}: {r.problem}\n    {r.expr}" for r in results if not r.ok]
    assert not failures, "panels without data:\n" + "\n".join(failures)
    pending = [r for r in results if r.pending]
    assert all(r.uid == "kvlab-pd-dp" for r in pending)
    landed = [f"{r.panel} ({r.pending})" for r in pending if r.series]
    if landed:
        print("pending dashboard queries that now return data (drop them from PENDING):", landed)
    # both phases are on the before/after panels
    policies = {s["metric"]["policy"] for s in query_range(
        prometheus, f"sum by (policy) ({n.KVLAB_REQUESTS}_total)", start, end, 2)}
    assert policies == {"round-robin", "kv-aware"}


def _reads_pd(expr: str) -> bool:
    return any(m in expr for m in PD_METRICS)


def test_pd_panels_return_data_on_the_pd_run(labs, pd_prometheus):
    run, start, end = labs["pd"]
    results = [r for r in verify(pd_prometheus, start, end) if _reads_pd(r.expr)]
    assert {r.panel for r in results} == {"P/D decisions by reason", "KV transfer time p50 / p95"}
    assert not [r for r in results if r.pending], "P/D metrics are exported: nothing about them is pending"
    failures = [f"{r.panel} / {r.ref}: {r.problem}\n    {r.expr}" for r in results if not r.ok]
    assert not failures, "P/D panels without data:\n" + "\n".join(failures)
    # the run made both decisions the panel tells apart, and the transfers it timed were real pulls
    decisions = {(s["metric"]["decision"], s["metric"]["reason"]) for s in query_range(
        pd_prometheus, f"sum by (decision, reason) ({n.KVLAB_PD_DECISIONS}_total)", start, end, 2)}
    assert ("split", "uncached-above-threshold") in decisions and ("unified", "cached-on-decode") in decisions
    pulls = query_range(pd_prometheus, f"sum({n.KVLAB_KV_TRANSFER_SECONDS}_count)", start, end, 2)
    assert pulls and max(float(v) for _, v in pulls[0]["values"]) > 0
    splits = sum(1 for line in (run / "phase-1-kv-aware" / "requests.jsonl").read_text().splitlines()
                 if json.loads(line).get("pd") == "split")
    assert splits > 0


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
    assert upstream.role == n.SPAN_UPSTREAM and upstream.parent_id == gateway.span_id
    d = decision_of(t)
    assert d.chosen == engine.attr(n.REPLICA) and d.candidates and d.prompt_tokens


def test_traces_explain_on_the_run(lab, tmp_path: Path):
    run, _, _ = lab
    html = tmp_path / "explain.html"
    out = subprocess.run([sys.executable, "-m", "kvlab.cli", "traces", "explain", "--run-dir", str(run), "--html", str(html)],
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
