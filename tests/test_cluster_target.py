"""`kvlab bench --target cluster:...` and `kvlab lab --cluster`, without a cluster.

The lab's cluster mode runs end to end against a local simulator: replica sim-0 stands in for the
baseline Service URL, sim-1 for the gateway URL (`cluster_target` is monkeypatched to return
them). The cache resets go through the real `reset_prefix_caches` with a fake CoreV1Api that lists
real V1Pod objects and forwards each pod-proxy POST to a simulator's /reset_prefix_cache
(tests/fake_cluster.py; test_notebooks_kind.py runs the notebooks against the same fake).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import IN_CI, free_port, sim_process

if not IN_CI:  # in CI a missing client fails at import instead of skipping
    pytest.importorskip("kubernetes")

from fake_cluster import FakeCore
from fake_cluster import pod as _pod
from kvlab import lab
from kvlab.load import cli as bench_cli
from kvlab.stack.kind import (
    caches,
    forward,
)
from kvlab.stack.kind.manifests import render
from kvlab.stack.kind.objects import REPLICA_SELECTOR, Cluster
from kvlab.topology import Topology

# ----------------------------------------------------------------------------- kvlab bench


def test_bench_resolves_cluster_targets_and_passes_urls_through(monkeypatch):
    calls = []

    def fake(which, context=None, namespace="kvlab", via="auto"):
        calls.append((which, context, namespace))
        return f"http://127.0.0.1:9/{which}"

    monkeypatch.setattr(forward, "cluster_target", fake)
    assert bench_cli.resolve_target("cluster:baseline", "kind-x", "ns") == "http://127.0.0.1:9/baseline"
    assert bench_cli.resolve_target("cluster:gateway", "kind-kvlab", "kvlab") == "http://127.0.0.1:9/gateway"
    assert bench_cli.resolve_target("http://10.0.0.1:8000", "kind-x", "ns") == "http://10.0.0.1:8000"
    assert calls == [("baseline", "kind-x", "ns"), ("gateway", "kind-kvlab", "kvlab")]


@pytest.mark.processes
def test_bench_imports_the_kind_path_only_for_cluster_targets():
    code = ("import sys; from kvlab.load.cli import resolve_target; resolve_target('http://x:1', None, 'kvlab'); "
            "print(any(m.startswith(('kvlab.stack.kind', 'kubernetes')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_bench_rejects_an_unknown_cluster_target(capsys, tmp_path):
    assert bench_cli.main(["--target", "cluster:jaeger", "--run-dir", str(tmp_path)]) == 1
    assert "must be 'gateway' or 'baseline'" in capsys.readouterr().out
    assert not (tmp_path / "requests.jsonl").exists()


# ----------------------------------------------------------------------------- GPU manifests


def test_gpu_replicas_accept_reset_prefix_cache():
    manifests = [x for ms in render(Topology(), Cluster(gpu=True)).values() for x in ms]
    replicas = [x for x in manifests if x["kind"] == "Deployment"
                and x["metadata"]["labels"].get("app.kubernetes.io/component") == "replica"]
    assert replicas
    for d in replicas:
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["VLLM_SERVER_DEV_MODE"] == "1"


# ----------------------------------------------------------------------------- kvlab lab --cluster


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    with sim_process(tmp_path_factory.mktemp("sims"), "--replicas", "2", "--no-kv-events",
                     "--ports", f"{free_port()},{free_port()}", "--time-scale", "0.2") as (_, info):
        yield [r["url"] for r in info["replicas"]]


@pytest.fixture(scope="module")
def cluster_lab(sims, tmp_path_factory):
    service_url, gateway_url = sims
    root = tmp_path_factory.mktemp("cluster-lab")
    core = FakeCore([_pod("kvlab-replicas-a"), _pod("kvlab-replicas-b"), _pod("kvlab-replicas-c"),
                     _pod("kvlab-replicas-d", ready=False)],
                    {"kvlab-replicas-a": service_url, "kvlab-replicas-b": gateway_url})
    targets: list[tuple[float, str, str | None, str]] = []

    def fake_target(which, context=None, namespace="kvlab", via="auto"):
        targets.append((time.time(), which, context, namespace))
        return {"baseline": service_url, "gateway": gateway_url}[which]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLAB_RUNS_DIR", str(root / "runs"))
        mp.setattr(forward, "cluster_target", fake_target)
        mp.setattr(caches, "core_api", lambda context: core)
        console = lab.Console(record=True, width=160, file=open(os.devnull, "w"))  # noqa: SIM115
        run_dir = lab.run_lab(lab.parser().parse_args(
            ["--cluster", "--context", "kind-test", "--namespace", "kvlab", "--duration", "4", "--users", "2",
             "--seed", "5", "--run-dir", str(root / "runs" / "lab")]), console)
    return run_dir, core, targets, console.export_text()


PHASES = ["baseline-service", "gateway-kv-aware"]


@pytest.mark.processes
def test_cluster_lab_runs_the_service_then_the_gateway_with_the_same_workload(cluster_lab, sims):
    run_dir, _, targets, _ = cluster_lab
    assert [(which, ctx, ns) for _, which, ctx, ns in targets] == [("baseline", "kind-test", "kvlab"),
                                                                   ("gateway", "kind-test", "kvlab")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["phases"]) == PHASES
    for n, (phase, url) in enumerate(zip(PHASES, sims), 1):
        s = summary["phases"][phase]
        assert s["ok"] >= 2 and s["errors"] == 0, s
        assert s["target"] == url and s["seed"] == 5 and s["users"] == 2 and s["workload"] == "shared-prefix"
        records = [json.loads(x) for x in (run_dir / f"phase-{n}-{phase}" / "requests.jsonl").read_text().splitlines()]
        assert records and {r["phase"] for r in records} == {phase}
        assert {r["replica"] for r in records} == {f"sim-{n - 1}"}   # each phase hit its own stand-in
    assert summary["cluster"]["context"] == "kind-test" and summary["replicas"] == 3


@pytest.mark.processes
def test_caches_are_reset_on_every_ready_pod_before_each_phase(cluster_lab):
    run_dir, core, _, out = cluster_lab
    assert core.listed and all(sel == REPLICA_SELECTOR and ns == "kvlab" for ns, sel in core.listed)
    names = [name for _, name, _, _ in core.posts]
    per_phase = ["kvlab-replicas-a:8000", "kvlab-replicas-b:8000", "kvlab-replicas-c:8000"]
    assert names == per_phase * 2                        # the Pending pod d is never touched
    assert {path for _, _, _, path in core.posts} == {"reset_prefix_cache"}
    for n, phase in enumerate(PHASES):
        records = [json.loads(x) for x in (run_dir / f"phase-{n + 1}-{phase}" / "requests.jsonl").read_text().splitlines()]
        resets = [t for t, *_ in core.posts[3 * n: 3 * n + 3]]
        assert max(resets) < min(r["ts"] for r in records)
        if n:   # phase 2's resets come after phase 1 finished
            before = [json.loads(x) for x in (run_dir / f"phase-1-{PHASES[0]}" / "requests.jsonl").read_text().splitlines()]
            assert min(resets) > max(r["ts"] + r["e2e_ms"] / 1000 for r in before)
    resets = json.loads((run_dir / "summary.json").read_text())["cluster"]["cache_resets"]
    assert resets[PHASES[1]]["kvlab-replicas-a:8000"] is None
    assert "404" in resets[PHASES[1]]["kvlab-replicas-c:8000"]
    # the refused reset is a warning, once per phase, and the lab still finished
    assert out.count("kvlab-replicas-c:8000: reset_prefix_cache refused") == 2
    assert "VLLM_SERVER_DEV_MODE" in out


@pytest.mark.processes
def test_unknown_hit_rates_are_n_a_not_numbers(cluster_lab):
    run_dir, _, _, out = cluster_lab
    summary = json.loads((run_dir / "summary.json").read_text())
    for phase in PHASES:   # no x-kvlab-* gateway headers from the stand-ins: available/predicted unknown
        hit = summary["phases"][phase]["hit_rate"]
        assert hit["available"] is None and hit["predicted"] is None
        assert hit["delivered"] is not None    # the engine's cached_tokens still count
    lines = out.splitlines()   # the table leaves out a row no phase has a value for (load/table.py)
    assert not any("hit rate available" in line or "hit rate predicted" in line for line in lines)
    assert any("hit rate delivered" in line for line in lines)
    html = (run_dir / "report.html").read_text()
    assert "baseline-service vs gateway-kv-aware" in html
    row = html[html.index("hit rate predicted"):].split("</tr>")[0]
    assert row.count("<td>n/a</td>") == 2


def test_cluster_mode_refuses_local_stack_options(capsys):
    assert lab.main(["--cluster", "--policies", "random"]) == 1
    assert "--policies" in capsys.readouterr().out
