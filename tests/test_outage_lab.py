"""A replica SIGKILLed under load and restarted (`kvlab lab --topology faults`, kvlab.scenarios.outage):
one end-to-end run on real simulator processes, with the scenario's thresholds lowered so it is
short; and the topology's `faults:` section checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from kvlab.errors import ConfigError
from kvlab.topology import Topology, load_topology

LABS = Path(__file__).resolve().parents[1] / "labs" / "topologies"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    data = yaml.safe_load((LABS / "faults.yaml").read_text())
    data["faults"].update(after_requests=12, after_restart=24)   # b hits its cache again by then
    topology = root / "faults.yaml"
    topology.write_text(yaml.safe_dump(data))
    run_dir = root / "run"
    env = dict(os.environ, KVLAB_RUNS_DIR=str(root / "runs"))
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "lab", "--topology", str(topology), "--quick",
                           "--duration", "4", "--run-dir", str(run_dir)],
                          env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_no_request_fails_while_a_replica_is_killed_and_restarted(run):
    outage = json.loads((run / "summary.json").read_text())["outage"]
    records = [json.loads(line) for line in (run / "phase-1-kv-aware" / "requests.jsonl").open()]
    assert outage["in_flight_at_kill"] > 0, "b should have been serving streams when it was killed"
    assert outage["failed"] == 0 and not any(r.get("error") for r in records)
    assert outage["resumes"] > 0 and outage["resumes_by_reason"]
    assert outage["back_at"] is not None and outage["down_s"] > 0, "the replica should have been restarted"
    assert outage["after_restart_on_replica"] > 0, "the restarted replica should be routed to again"
    assert outage["hit_rate_after_restart"] > 0, "its cache should warm up again"
    assert sum(r["ts"] >= outage["back_at"] for r in records) >= 24   # the phase ran on after the restart
    samples = json.loads((run / "phase-1-kv-aware" / "outage.json").read_text())["samples"]
    assert any(not s["up"] for s in samples) and samples[-1]["up"]
    assert (run / "report.html").exists()


@pytest.mark.slow
def test_traces_explain_finds_the_resumed_request(run):
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "traces", "explain", "--resumed", "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "resume 1: b failed" in proc.stdout


def test_the_faults_section_names_a_pool_and_needs_a_second_one():
    data = yaml.safe_load((LABS / "faults.yaml").read_text())
    assert load_topology(LABS / "faults.yaml").faults is not None
    with pytest.raises(ConfigError, match="names no pool"):
        msgspec.convert({**data, "faults": {"kill": "c"}}, Topology)
    with pytest.raises(ConfigError, match="second pool"):
        msgspec.convert({**data, "pools": [{"name": "b", "replicas": 1}]}, Topology)
