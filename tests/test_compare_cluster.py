"""`kvlab compare --cluster`, without a cluster.

The fake cluster is a local stack: one simulator process with 2 replicas (the replica pods a and
b), a round-robin `kvlab gateway` standing in for the baseline Service and llm-d, a kv-aware one
for the deployed gateway and gateway-api (`cluster_target` is monkeypatched to return them). The
cache resets and the per-pod request counters go through the real `ClusterStack` code with
tests/fake_cluster.py's CoreV1Api, which forwards each pod-proxy POST and GET to the replica
standing in for that pod.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import IN_CI

if not IN_CI:  # in CI a missing client fails at import instead of skipping
    pytest.importorskip("kubernetes")

from rich.console import Console

from fake_cluster import FakeCore, pod
from kvlab.compare import command
from kvlab.scenarios import faults
from kvlab.stack.kind import caches, forward
from kvlab.stack.launch import sim_args
from kvlab.topology import load_topology
from test_compare import TOPOLOGY

ROUTERS = ["baseline", "gateway-api", "llm-d", "kv-aware"]   # the default with --cluster (TOPOLOGY: kv-aware)
TARGETS = {"baseline": "baseline", "gateway-api": "gateway-api", "llm-d": "llm-d", "kv-aware": "gateway"}
PEERS = [True, False, True, False]                          # kube-proxy and llm-d are not kvlab
PODS = ["kvlab-replicas-a", "kvlab-replicas-b"]


@pytest.fixture
def no_cluster(monkeypatch, tmp_path):
    """Every way to reach a cluster fails the test; runs would land in tmp_path/runs."""
    def forbidden(*args, **kwargs):
        raise AssertionError("this must not reach a cluster")

    monkeypatch.setattr(caches, "core_api", forbidden)
    monkeypatch.setattr(forward, "cluster_target", forbidden)
    monkeypatch.setattr(forward, "open_forward", forbidden)
    monkeypatch.setenv("KVLAB_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "t.yaml").write_text(TOPOLOGY)
    return tmp_path


def test_dry_run_names_every_router_and_its_url_and_needs_no_cluster(no_cluster, capsys):
    assert command.main(["--cluster", "--dry-run", "--topology", str(no_cluster / "t.yaml"),
                         "--context", "kind-lab", "--namespace", "ns"]) == 0
    out = capsys.readouterr().out
    assert "kvlab cluster deploy observability baseline gateway-api llm-d gateway" in out
    assert "context kind-lab" in out and "kind-lab/ns" in out
    lines = [line for line in out.splitlines() if line.startswith("router ")]
    assert len(lines) == 4, out
    for i, (name, peer, line) in enumerate(zip(ROUTERS, PEERS, lines, strict=True), 1):
        assert line.startswith(f"router {i}/4 {name}{' (peer)' if peer else ''}: "), line
        assert f"bench {forward.node_port_url(TARGETS[name])}/v1" in line, line
    assert not (no_cluster / "runs").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--engine", "vllm"], "deployed; --engine: only for a local compare"),
    (["--replicas", "3"], "deployed; --replicas: only for a local compare"),
    (["--router", "mine=my-router --port {port}", "--policies", "mine"], "deployed; --router: only for a local"),
    (["--policies", "baseline,vllm-router:cache_aware"], "vllm-router:cache_aware: kvlab starts peers as local "
                                                        "processes, which cannot reach the cluster's pod IPs"),
    (["--policies", "baseline,prefix"], "--cluster --policies: 'prefix' is not deployed"),
])
def test_local_only_flags_are_config_errors_with_cluster(no_cluster, capsys, flags, message):
    assert command.main(["--cluster", "--topology", str(no_cluster / "t.yaml"), *flags]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "kvlab compare: " in out and message in out, out
    assert not (no_cluster / "runs").exists()


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare-cluster")
    (root / "t.yaml").write_text(TOPOLOGY)
    topology = load_topology(root / "t.yaml")
    with faults.sim(root, "sim", "--replicas", "2", *sim_args(topology.sim)) as (_, replicas), \
            faults.gateway(root, replicas, policy="round-robin") as (_, service), \
            faults.gateway(root, replicas, policy="kv-aware") as (_, gateway):
        core = FakeCore([pod(PODS[0]), pod(PODS[1]), pod("kvlab-replicas-c", ready=False)],
                        {PODS[0]: replicas[0].url, PODS[1]: replicas[1].url})
        entries = {"baseline": service, "llm-d": service, "gateway-api": gateway, "gateway": gateway}

        def no_jaeger(*args, **kwargs):
            raise OSError("the fake cluster has no Jaeger")

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVLAB_RUNS_DIR", str(root / "runs"))
            mp.setattr(forward, "cluster_target", lambda which, context=None, namespace="kvlab", via="auto":
                       entries[which])
            mp.setattr(forward, "open_forward", no_jaeger)
            mp.setattr(caches, "core_api", lambda context: core)
            console = Console(record=True, width=220, file=open(os.devnull, "w"))  # noqa: SIM115
            run_dir = command.run_compare(["--cluster", "--topology", str(root / "t.yaml"), "--context", "kind-test",
                                           "--duration", "3", "--users", "2", "--seed", "5", "--min-requests", "6",
                                           "--run-dir", str(root / "runs" / "compare")], console)
    assert run_dir is not None
    return run_dir, core, console.export_text()


def _rows(run_dir):
    doc = json.loads((run_dir / "compare.json").read_text())
    return doc, doc["workloads"]["shared-prefix"]["routers"]


@pytest.mark.processes
def test_cluster_compare_measures_every_cluster_router_like_a_local_compare(compared):
    run_dir, _, out = compared
    doc, rows = _rows(run_dir)
    assert [r["router"] for r in rows] == ROUTERS and doc["routers"] == ROUTERS
    assert [r["peer"] for r in rows] == PEERS
    assert doc["engine"] == "sim" and doc["replicas"] == 2 and doc["machine"] is None
    assert doc["cluster"]["context"] == "kind-test" and doc["cluster"]["replica_pods"] == PODS
    for r in rows:
        assert r["ok"] >= 6 and r["errors"] == 0, r
        assert r["oracle_hit_rate"] > 0 and r["hit_rate"] <= r["oracle_hit_rate"] + 1e-9, r
        assert r["peer_counters"] == {}
    page = (run_dir / "compare.html").read_text()
    assert "Hit rate vs the oracle" in page and all(name in page for name in ROUTERS)
    assert "baseline (peer)" in out and "llm-d (peer)" in out and "gateway-api (peer)" not in out
    assert "of oracle" in out and "oracle: Belady on one pooled cache of 2 × 160 blocks of 16" in out
    assert "answered with policy" not in out


@pytest.mark.processes
def test_balance_is_each_replica_pods_own_counter_through_the_pod_proxy(compared):
    run_dir, core, _ = compared
    _, rows = _rows(run_dir)
    assert {(name.split(":")[0], path) for name, path in core.gets} == {(p, "metrics") for p in PODS}
    for r in rows:
        assert set(r["replica_requests"]) == set(PODS), r
        assert abs(sum(r["replica_requests"].values()) - r["ok"]) <= 2, r   # requests in flight at the end
    baseline = rows[0]   # the round-robin stand-in for kube-proxy spreads over both pods
    assert min(baseline["replica_requests"].values()) > 0, baseline


@pytest.mark.processes
def test_every_ready_pods_cache_is_reset_before_each_router_and_after_the_last(compared):
    run_dir, core, _ = compared
    doc, _ = _rows(run_dir)
    per_router = [f"{p}:8000" for p in PODS]                 # the Pending pod c is never touched
    assert [name for _, name, _, _ in core.posts] == per_router * len(ROUTERS)
    assert {path for *_, path in core.posts} == {"reset_prefix_cache"}
    assert doc["cluster"]["cache_resets"]["shared-prefix"] == {n: dict.fromkeys(per_router) for n in ROUTERS}
    previous: list[dict] = []
    for n, name in enumerate(ROUTERS):
        records = [json.loads(x) for x in
                   (run_dir / "shared-prefix" / f"phase-{n + 1}-{name}" / "requests.jsonl").read_text().splitlines()]
        resets = [t for t, *_ in core.posts[2 * n: 2 * n + 2]]
        assert max(resets) < min(r["ts"] for r in records)
        if previous:
            assert min(resets) > max(r["ts"] + r["e2e_ms"] / 1000 for r in previous)
        previous = records
