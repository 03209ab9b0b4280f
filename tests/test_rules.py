"""The lab's Prometheus rules (kvlab.dashboards.rules → dashboards/rules/kvlab.rules.yaml): valid for
promtool, unit-tested with `promtool test rules`, written only with kvlab.telemetry.names metrics,
loaded by the local and the kind Prometheus, and firing on a real stack when a replica dies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import requests
import yaml

from conftest import require_binary
from kvlab.dashboards import rules
from kvlab.stack.base import read_info
from kvlab.stack.kind.manifests import render
from kvlab.stack.kind.objects import Cluster
from kvlab.stack.prometheus import rules_file, scrape_config
from kvlab.telemetry import names as n
from kvlab.topology import load_topology

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "dashboards" / rules.FILE
UNIT_TESTS = ROOT / "tests" / "promtool" / "kvlab.rules.test.yaml"


def test_committed_rules_equal_generated_and_pass_promtool_check():
    assert RULES.read_text() == rules.render(), "run `kvlab dashboards` and commit"
    promtool = require_binary("promtool")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules.RECORDS) + len(rules.ALERTS)} rules found" in out.stdout


def test_promtool_unit_tests():
    promtool = require_binary("promtool")
    out = subprocess.run([promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True,
                         timeout=120, cwd=UNIT_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert tested == {a["alert"] for a in rules.ALERTS}, "every alert has a promtool case"


def test_rules_cover_the_issue_and_name_only_known_metrics():
    alerts = {a["alert"] for a in rules.ALERTS}
    assert {"KvlabPrefixHitRateLow", "KvlabIndexOverpromises", "KvlabKVEventsStalled", "KvlabIndexStale",
            "KvlabTokenizationSlow", "KvlabReplicaEjected", "KvlabDesiredReplicasAboveCurrent"} <= alerts
    known = {v for k, v in vars(n).items() if k.startswith(("VLLM_", "KVLAB_")) and isinstance(v, str)}
    known = {m + suffix for m in known for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    exprs = [*rules.RECORDS.values(), *(a["expr"] for a in rules.ALERTS)]
    for expr in exprs:
        for metric in re.findall(r"(?<![:\w])(vllm:[a-z_:]+|kvlab_[a-z_]+)", expr):
            assert metric in known, f"{metric} is not a name from kvlab.telemetry.names"
    for expr in (a["expr"] for a in rules.ALERTS):   # recording rules used by alerts exist
        for record in re.findall(r"\bkvlab:[a-z0-9_]+:[a-z0-9_]+", expr):
            assert record in rules.RECORDS, record


def test_local_and_kind_prometheus_load_the_rules(tmp_path: Path):
    assert scrape_config(["replicas", "gateway"], tmp_path)["rule_files"] == [str(rules_file(tmp_path))]
    manifests = [m for ms in render(load_topology(ROOT / "labs" / "topologies" / "quickstart.yaml"), Cluster()).values()
                 for m in ms]
    config_map = next(m for m in manifests if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "kvlab-prometheus")
    assert config_map["data"]["kvlab.rules.yaml"] == rules.render()
    mounted = "/etc/prometheus/kvlab.rules.yaml"   # the ConfigMap is mounted at /etc/prometheus
    assert yaml.safe_load(config_map["data"]["prometheus.yml"])["rule_files"] == [mounted]
    deployment = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "kvlab-prometheus")
    mounts = deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "config", "mountPath": "/etc/prometheus", "readOnly": True} in mounts
    promtool = require_binary("promtool")       # the config as the kind Prometheus reads it, minus the
    etc = tmp_path / "etc"                      # scrape jobs (Debian's build lacks kubernetes_sd)
    etc.mkdir()
    config = yaml.safe_load(config_map["data"]["prometheus.yml"])
    config.update(rule_files=[str(etc / "kvlab.rules.yaml")], scrape_configs=[])
    (etc / "prometheus.yml").write_text(yaml.safe_dump(config))
    (etc / "kvlab.rules.yaml").write_text(config_map["data"]["kvlab.rules.yaml"])
    out = subprocess.run([promtool, "check", "config", str(etc / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"SUCCESS: {len(rules.RECORDS) + len(rules.ALERTS)} rules found" in out.stdout, out.stdout + out.stderr


# ---- a real stack: a replica dies, Prometheus fires KvlabReplicaEjected ---------------------------------


def _alerts(prometheus: str) -> list[dict]:
    with urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=5) as resp:
        return json.load(resp)["data"]["alerts"]


@pytest.mark.slow
@pytest.mark.prometheus
def test_replica_ejected_fires_in_prometheus(tmp_path: Path):
    require_binary("prometheus")
    topology = tmp_path / "two.yaml"
    topology.write_text("name: two\nengine: sim\npools: [{name: a, replicas: 1}, {name: b, replicas: 1}]\n"
                        "sim: {time_scale: 0.2, num_blocks: 512}\ngateway: {policy: kv-aware}\n"
                        "observability: {traces: \"off\", prometheus: auto}\n")
    env = dict(os.environ, KVLAB_RUNS_DIR=str(tmp_path / "runs"))

    def kvlab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvlab.cli", *args], env=env, capture_output=True, text=True,
                              timeout=180)

    up = kvlab("up", "--topology", str(topology))
    supervisor = 0
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        stack = read_info(tmp_path / "runs" / "latest")
        assert stack is not None
        prometheus = stack.prometheus
        assert prometheus, "the stack started without Prometheus"
        body = {"model": "kvlab-tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
        for _ in range(4):
            assert requests.post(f"{stack.gateway}/v1/chat/completions", json=body, timeout=30).status_code == 200
        victim = next(p for p in stack.processes if p.name == "engine-b")   # pool b: replica "b"
        assert [r.name for r in stack.replicas] == ["a", "b"]
        assert not [a for a in _alerts(prometheus) if a["labels"]["alertname"] == "KvlabReplicaEjected"]
        # the supervisor restarts a dead child at once; paused, it cannot, so "b" stays down
        assert stack.supervisor is not None
        supervisor = stack.supervisor.pid
        os.kill(supervisor, signal.SIGSTOP)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        firing: list[dict] = []
        while time.monotonic() - killed_at < 60 and not firing:
            time.sleep(1)
            firing = [a for a in _alerts(prometheus)
                      if a["labels"]["alertname"] == "KvlabReplicaEjected" and a["state"] == "firing"]
        assert firing, f"no KvlabReplicaEjected firing 60 s after the kill: {_alerts(prometheus)}"
        assert [a["labels"]["replica"] for a in firing] == ["b"]
        assert firing[0]["labels"]["severity"] == "critical"
        print(f"KvlabReplicaEjected firing {time.monotonic() - killed_at:.1f} s after SIGKILL: {firing[0]}")
    finally:
        if supervisor:
            os.kill(supervisor, signal.SIGCONT)
        down = kvlab("down")
        assert down.returncode == 0, down.stdout + down.stderr
