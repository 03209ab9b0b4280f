"""Dashboards as code: the committed files equal what the code generates, validate against the
schema, query only metric names from kvlab.telemetry.names, and provisioning matches them."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from kvlab import dashboards
from kvlab.dashboards.catalog import DASHBOARDS, PENDING_METRICS, dashboard_json, panel_queries, render
from kvlab.dashboards.schema import validate
from kvlab.dashboards.verify import grafana_expr
from kvlab.telemetry import names as n

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "dashboards"


def test_committed_files_equal_generated(tmp_path: Path):
    assert dashboards.main(["--dashboards-dir", str(COMMITTED), "--check"]) == 0, "run `kvlab dashboards` and commit"
    copy_dir = tmp_path / "dashboards"
    shutil.copytree(COMMITTED, copy_dir)
    path = copy_dir / "routing.json"
    path.write_text(path.read_text().replace("kvlab_gateway_decisions_total", "kvlab_gateway_decision_total"))
    assert dashboards.main(["--dashboards-dir", str(copy_dir), "--check"]) == 1
    assert set(render()) == {str(p.relative_to(COMMITTED)) for p in COMMITTED.rglob("*") if p.is_file()}


def test_every_dashboard_validates_and_broken_ones_do_not():
    uids = set()
    for module in DASHBOARDS.values():
        data = dashboard_json(module)
        validate(data)
        uids.add(data["uid"])
    assert uids == {"kvlab-before-after", "kvlab-routing", "kvlab-replicas", "kvlab-pd-dp"}
    good = dashboard_json(DASHBOARDS["routing.json"])
    for breakage in (lambda d: d["panels"][1]["targets"][0].pop("expr"),
                     lambda d: d["panels"][2].update(id=d["panels"][1]["id"]),
                     lambda d: d["panels"][1]["gridPos"].update(w=30),
                     lambda d: d["panels"][1]["datasource"].update(uid="elsewhere")):
        bad = copy.deepcopy(good)
        breakage(bad)
        with pytest.raises(ValueError):
            validate(bad)


def _known_metrics() -> set[str]:
    base = {v for k, v in vars(n).items() if k.startswith(("VLLM_", "KVLAB_")) and isinstance(v, str)}
    return {m + suffix for m in base for suffix in ("", "_total", "_bucket", "_sum", "_count")}


def test_queries_use_only_named_metrics():
    known = _known_metrics()
    seen = set()
    for module in DASHBOARDS.values():
        for title, _, expr in panel_queries(dashboard_json(module)):
            for metric in re.findall(r"\b(vllm:[a-z_:]+|kvlab_[a-z_]+)", expr):
                assert metric in known, f"{title}: {metric} is not a name from kvlab.telemetry.names"
                seen.add(metric)
    # the dashboards the issue asks for read the metrics that matter
    for metric in (f"{n.KVLAB_GATEWAY_TTFT}_bucket", f"{n.KVLAB_PREFIX_TOKENS}_total", f"{n.KVLAB_DECISIONS}_total",
                   f"{n.KVLAB_ROUTING_SECONDS}_bucket", n.VLLM_NUM_REQUESTS_WAITING, n.VLLM_KV_CACHE_USAGE,
                   f"{n.VLLM_PREFIX_CACHE_HITS}_total", f"{n.KVLAB_PD_DECISIONS}_total", n.KVLAB_DESIRED_REPLICAS):
        assert metric in seen


def test_pending_queries_are_exactly_the_open_issues():
    # issue 9's kvlab_gateway_desired_replicas is exported by every gateway (its panel's data is
    # checked on a real autoscaling run: tests/test_autoscaling_lab.py)
    assert PENDING_METRICS == {"kvlab-pd-dp": {}}


def test_provisioning_matches_the_dashboards():
    files = render()
    prom = yaml.safe_load(files["provisioning/datasources/prometheus.yaml"])["datasources"][0]
    jaeger = yaml.safe_load(files["provisioning/datasources/jaeger.yaml"])["datasources"][0]
    assert (prom["type"], jaeger["type"]) == ("prometheus", "jaeger")
    assert prom["jsonData"]["exemplarTraceIdDestinations"] == [{"name": "trace_id", "datasourceUid": jaeger["uid"]}]
    used = {p["datasource"]["uid"] for f, t in files.items() if f.endswith(".json")
            for row in json.loads(t)["panels"] for p in [row, *row.get("panels", [])] if "datasource" in p}
    assert used == {prom["uid"]}
    provider = yaml.safe_load(files["provisioning/dashboards/kvlab.yaml"])["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"] == "${KVLAB_DASHBOARDS_DIR}"
    # latency panels carry exemplars and a link to the traces
    ttft = next(p for p in dashboard_json(DASHBOARDS["before-after.json"])["panels"]
                if p["title"].startswith("TTFT p50 / p95 by policy"))
    assert all(t["exemplar"] for t in ttft["targets"]) and "jaeger" in ttft["links"][0]["url"]


def test_grafana_macros():
    assert grafana_expr("rate(x[$__rate_interval]) + increase(x[$__range]) + x[$__interval]", 10, 2, 120) == \
        "rate(x[10s]) + increase(x[120s]) + x[2s]"
