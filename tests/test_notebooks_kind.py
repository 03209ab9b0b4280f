"""Lab 02 with TARGET = "kind-cpu", against the fake cluster of test_cluster_target.py.

The "cluster" is a simulator stack (`kvlab up --topology quickstart`: 4 replicas and the kv-aware
gateway) with a round-robin `kvlab gateway` as the cache-blind baseline Service. The notebook's
kernel gets tests/fake_cluster.py installed right after the parameters cell: the Service URLs
resolve to those two, and the API server is a fake CoreV1Api that lists one real V1Pod per
replica and forwards each pod-proxy POST to that replica. Everything else is the notebook's own
kind path (`ensure_stack` records the cluster, `run_phase` runs through `ClusterStack`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import IN_CI, require

if not IN_CI:
    pytest.importorskip("kubernetes")
    pytest.importorskip("nbclient")

from kvlab.stack.attached import AttachedStack
from kvlab.stack.base import read_info
from kvlab.stack.launch import KVLAB
from notebook_runs import LABS, _execute, _kernel_python, _runs_env, nbformat

TESTS = Path(__file__).resolve().parent
PHASES = ["round-robin", "kv-aware"]


def _records(run: Path, n: int, policy: str) -> list[dict]:
    return [json.loads(x) for x in (run / f"phase-{n}-{policy}" / "requests.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_lab_02_on_a_kind_target_resets_every_replica_pod_between_phases():
    _kernel_python()
    with _runs_env("kvlab-nb-kind-") as runs:
        cluster_runs = runs / "sim-cluster"       # under `runs`: the teardown stops it by pid too
        up = subprocess.run([*KVLAB, "up", "--topology", "quickstart", "--timeout", "120"], capture_output=True,
                            text=True, timeout=180, env=dict(os.environ, KVLAB_RUNS_DIR=str(cluster_runs)))
        info = read_info(cluster_runs / "latest")
        require(up.returncode == 0 and info is not None, f"a simulator stack (kvlab up: {up.stdout[-800:]})")
        assert info is not None
        service = AttachedStack(info).gateway_for("round-robin")     # kube-proxy's stand-in, stopped by pid
        pods = {f"kvlab-replicas-{i}": r.url for i, r in enumerate(info.replicas)}
        refusing = "kvlab-replicas-old"         # a ready pod whose vLLM lacks VLLM_SERVER_DEV_MODE: 404
        log = runs.parent / "pod-proxy.jsonl"
        spec = runs.parent / "fake-cluster.json"
        spec.write_text(json.dumps({"services": {"baseline": service, "gateway": info.gateway},
                                    "pods": {**pods, refusing: None}, "refusing": [refusing], "log": str(log)}))
        overrides = (f'TARGET = "kind-cpu"\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\n'
                     f"import fake_cluster\nfake_cluster.install({str(spec)!r})")
        _execute(LABS / "02-kv-aware.ipynb", runs.parent / "02-kv-aware-kind.ipynb", overrides=overrides)

        run = (runs / "latest").resolve()
        stack = read_info(run)
        assert stack is not None and stack.target == "kind-cpu" and stack.context == "kind-kvlab"
        assert (stack.baseline, stack.gateway) == (service, info.gateway)
        posts = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        per_phase = len(pods) + 1
        assert len(posts) == 2 * per_phase == 10, posts
        before: list[dict] = []
        for n, policy in enumerate(PHASES, 1):
            records = _records(run, n, policy)
            summary = json.loads((run / f"phase-{n}-{policy}" / "summary.json").read_text())
            assert summary["target"] == (service if policy == "round-robin" else info.gateway)
            resets = posts[per_phase * (n - 1): per_phase * n]
            assert sorted(p["target"] for p in resets) == sorted(f"{name}:8000" for name in [*pods, refusing])
            assert {(p["namespace"], p["path"]) for p in resets} == {("kvlab", "reset_prefix_cache")}
            # every replica pod, through the pod proxy, answered 200 by the replica behind it
            assert {p["target"]: p["status"] for p in resets} == {**{f"{name}:8000": 200 for name in pods},
                                                                  f"{refusing}:8000": 404}
            assert max(p["done"] for p in resets) < min(r["ts"] for r in records)   # before this phase
            if before:                                                            # and after the last one
                assert min(p["t"] for p in resets) > max(r["ts"] + r["e2e_ms"] / 1000 for r in before)
            before = records
            assert {r["replica"] for r in records if not r.get("error")} == {r.name for r in info.replicas}
        # the refused reset is said in the notebook, once per phase
        executed = nbformat.read(runs.parent / "02-kv-aware-kind.ipynb", as_version=4)
        text = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
        assert text.count(f"warning: {refusing}:8000: reset_prefix_cache refused: HTTP 404") == 2, text[-2000:]
