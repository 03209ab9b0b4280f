"""The ramping-load autoscaling scenario (`kvlab lab --topology autoscale`, kvlab.scenarios.autoscale):
the ramp shape, Prometheus following scaled replicas through file_sd, the report section, and one
end-to-end run (real simulator processes, gateway, scaler, Locust, OTLP sink and Prometheus)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port, phase_result, require, require_binary
from kvlab.errors import ConfigError
from kvlab.load.measure import Record
from kvlab.load.ramp import Ramp, up_hold_down
from kvlab.report.autoscale import FIGURE_ID, section
from kvlab.stack.base import read_info
from kvlab.stack.prometheus import scrape_config, targets_file, write_targets
from kvlab.telemetry import names

ROOT = Path(__file__).resolve().parents[1]


def test_ramp_is_a_deterministic_piecewise_linear_user_count():
    r = Ramp(points=[(0, 1), (10, 11), (20, 11), (22, 1), (30, 1)])
    assert [r.users_at(t) for t in (0, 5, 10, 15, 21, 25, 30)] == [1, 6, 11, 11, 6, 1, 1]
    assert r.users_at(30.5) is None and r.peak == 11 and r.duration_s == 30
    assert Ramp.from_json(r.to_json()) == r
    for bad in ('{"points": [[0, 1]]}', '{"points": [[1, 1], [2, 2]]}', '{"points": [[0, 1], [0, 2]]}', "{x"):
        with pytest.raises(ConfigError):
            Ramp.from_json(bad)
    shape = up_hold_down(40, 12)
    users = [shape.users_at(t) for t in range(41)]
    peak_at = users.index(12)
    assert users[0] == 1 and 10 <= peak_at <= 16 and users[-1] == 1
    assert users[:peak_at + 1] == sorted(users[:peak_at + 1])      # rises, then holds and falls back
    assert users[30:] == [1] * 11                                   # idles long enough to scale down


def test_prometheus_reads_targets_from_files_the_stack_rewrites(tmp_path):
    config = scrape_config(["replicas", "gateway"], tmp_path, 1.0)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["replicas"]["file_sd_configs"][0]["files"] == [str(targets_file(tmp_path, "replicas"))]
    assert "static_configs" not in jobs["replicas"]
    path = write_targets(tmp_path, "replicas", ["127.0.0.1:1", "127.0.0.1:2"])
    assert json.loads(path.read_text()) == [{"targets": ["127.0.0.1:1", "127.0.0.1:2"], "labels": {}}]
    write_targets(tmp_path, "replicas", ["127.0.0.1:1"])
    assert json.loads(path.read_text())[0]["targets"] == ["127.0.0.1:1"]


def test_report_section_only_for_an_autoscaling_phase():
    records = [Record(ts=100.0 + i, ttft_ms=50.0 + i, e2e_ms=200.0, replica="r", error=None) for i in range(10)]
    data = {"samples": [{"t": 100.0 + i, "desired": 1 + (2 <= i <= 6), "running": 1 + (3 <= i <= 7),
                         "reason": "up:queue"} for i in range(10)],
            "actions": [{"t": 103.0, "direction": "up", "replica": "r-scaled-1", "to": 2, "reason": "up:queue",
                         "ready_ms": 900.0}],
            "users": [[100.0, 1], [104.0, 8]], "settings": {"scale_down_window_s": 6}}
    html = section({"kv-aware": phase_result("kv-aware", records, autoscale=data)})
    assert FIGURE_ID in html and "desired replicas" in html and "r-scaled-1" in html
    assert section({"kv-aware": phase_result("kv-aware", records)}) == ""


def test_the_shipped_autoscale_topology_enables_the_scenario():
    from kvlab.topology import load_topology

    topo = load_topology(ROOT / "labs" / "topologies" / "autoscale.yaml")
    assert topo.gateway.autoscale is not None and topo.gateway.autoscale.max_replicas > topo.total_replicas


# ---- end to end -------------------------------------------------------------------------------------

def _spans(traces_dir: Path, name: str) -> list[dict]:
    found = []
    for f in traces_dir.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    found += [s for s in ss.get("spans", []) if s["name"] == name]
    return found


def _attr(span: dict, key: str):
    for a in span.get("attributes", []):
        if a["key"] == key:
            v = a["value"]
            return v.get("stringValue", v.get("intValue", v.get("doubleValue")))
    return None


def _seconds_in_targets(actions: list[dict]) -> dict[str, float]:
    """host:port of every replica the scaler added -> seconds it was in the targets files (inf: to the
    end). An action's `t` is when it finished: "up" wrote the targets last, "down" first, then drained."""
    added: dict[str, float] = {}
    removed: dict[str, float] = {}
    for x in actions:
        for url in x["urls"]:
            addr = url.split("://", 1)[1]
            if x["direction"] == "up":
                added[addr] = x["t"]
            else:
                removed[addr] = x["t"] - x["ready_ms"] / 1000
    return {addr: removed.get(addr, float("inf")) - t for addr, t in added.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("autoscale")
    run_dir = root / "run"
    env = dict(os.environ, KVLAB_RUNS_DIR=str(root / "runs"))
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "lab", "--topology", "autoscale", "--quick",
                           "--run-dir", str(run_dir)], env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_recommendation_rises_under_the_ramp_and_falls_after_it(run):
    summary = json.loads((run / "summary.json").read_text())
    a = summary["autoscale"]
    assert a["desired_first"] == 1 and a["desired_peak"] >= 2
    assert a["desired_fell_after_peak"] and a["desired_last"] == 1
    assert a["scale_ups"] >= 1 and a["scale_downs"] >= 1 and a["running_max"] >= 2
    data = json.loads((run / "phase-1-kv-aware" / "autoscale.json").read_text())
    samples, ramp = data["samples"], data["ramp"]["points"]
    first_req = min(json.loads(line)["ts"] for line in (run / "phase-1-kv-aware" / "requests.jsonl").open())
    rose_t = next(s["t"] for s in samples if s["desired"] > a["desired_first"]) - first_req
    load_drops_at = ramp[-2][0]                     # the ramp is back at its base here
    assert rose_t < load_drops_at                   # it rose while the load was high (queues drained
                                                    # after it may still raise the peak on a busy machine)
    ups = [x for x in data["actions"] if x["direction"] == "up"]
    downs = [x for x in data["actions"] if x["direction"] == "down"]
    assert ups[0]["t"] < downs[0]["t"]
    assert downs[-1]["t"] - first_req > ramp[2][0]  # the scale-down came after the peak load
    assert summary["phases"]["kv-aware"]["ok"] >= 30 and summary["phases"]["kv-aware"]["errors"] == 0


@pytest.mark.slow
def test_scaling_actions_and_recommendations_are_spans_of_the_run(run):
    traces = run / "traces"
    scale = _spans(traces, names.SPAN_SCALE_ACTION)
    directions = [_attr(s, names.SCALE_DIRECTION) for s in scale]
    assert "up" in directions and "down" in directions
    assert all(_attr(s, names.SCALE_REPLICA) for s in scale)
    recs = _spans(traces, names.SPAN_AUTOSCALE)
    assert max(int(_attr(s, names.AUTOSCALE_DESIRED)) for s in recs) >= 2


@pytest.mark.slow
def test_report_has_the_autoscaling_figure(run):
    html = (run / "report.html").read_text()
    assert FIGURE_ID in html and "desired replicas" in html and "running replicas" in html
    assert "Autoscaling under a load ramp" in html


@pytest.mark.slow
@pytest.mark.prometheus
def test_prometheus_scraped_the_added_replica(run, tmp_path):
    require_binary("prometheus")
    from kvlab.dashboards.verify import query_range
    from kvlab.stack.prometheus import start_prometheus

    stack = read_info(run)
    assert stack is not None and stack.prometheus, "the run had no Prometheus"
    policy = yaml.safe_load((run / "gateway-policy.yaml").read_text())
    assert policy["autoscale"]["max_replicas"] == 3
    data = json.loads((run / "phase-1-kv-aware" / "autoscale.json").read_text())
    added = _seconds_in_targets(data["actions"])
    # Prometheus applies service-discovery changes at most every 5 s (discovery.Manager's `updatert`),
    # so a replica that was a target for less than that plus two scrapes may never be scraped.
    lasting = {addr for addr, s in added.items() if s >= 5 + 2}
    home = tmp_path / "replay"
    shutil.copytree(run / "prometheus" / "data", home / "prometheus" / "data")
    port = free_port()
    child = start_prometheus(home, {}, port)
    require(child is not None, "the prometheus binary")
    proc = child.popen
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.time() + 5
        start = end - 900
        seen = {r["metric"]["instance"] for r in query_range(base, 'up{job="replicas"} == 1', start, end, 1)}
        assert lasting and lasting <= seen, (added, seen)
        running = query_range(base, 'count(up{job="replicas"} == 1)', start, end, 1)
        assert max(float(v) for _, v in running[0]["values"]) >= 2
        desired = query_range(base, f"max({names.KVLAB_DESIRED_REPLICAS})", start, end, 1)
        assert max(float(v) for _, v in desired[0]["values"]) >= 2   # the dashboard panel has data
    finally:
        proc.terminate()
        proc.wait(30)
