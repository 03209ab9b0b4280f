"""`kvlab up/status/down`: a detached, healthy stack that leaves no process behind; shipped topologies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from kvlab.process import runs_command, still_running
from kvlab.stack.base import StackInfo, read_info
from kvlab.topology import load_topology

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_topology_parses():
    files = sorted((ROOT / "labs" / "topologies").glob("*.yaml"))
    assert files
    for f in files:
        assert load_topology(f).total_replicas > 0


def kvlab(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def small_topology(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("name: small\nengine: sim\npools: [{name: replicas, replicas: 2}]\n"
                    "sim: {time_scale: 0.2, num_blocks: 512}\ngateway: {policy: kv-aware}\n"
                    "observability: {traces: files, prometheus: \"off\"}\n")
    return path


def _pids(stack: StackInfo) -> list[tuple[int, list[str]]]:
    assert stack.supervisor is not None
    return [(p.pid, p.argv) for p in [*stack.processes, stack.supervisor]]


@pytest.mark.slow
def test_up_status_down_leaves_nothing_behind(tmp_path, small_topology):
    env = dict(os.environ, KVLAB_RUNS_DIR=str(tmp_path / "runs"))
    up = kvlab("up", "--topology", str(small_topology), env=env)
    stack = read_info(tmp_path / "runs" / "latest")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert stack is not None and stack.status == "running" and stack.policy == "kv-aware"
        assert {p.name for p in stack.processes} == {"traces", "engine-replicas", "gateway"}
        assert [r.name for r in stack.replicas] == ["sim-0", "sim-1"]
        assert stack.traces_dir and (stack.otlp_endpoint or "").startswith("http://127.0.0.1:")
        assert all(runs_command(pid, argv) for pid, argv in _pids(stack))
        assert Path(stack.run_dir).name == os.readlink(tmp_path / "runs" / "latest")
        body = {"model": "kvlab-tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
        resp = requests.post(f"{stack.gateway}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200 and resp.headers["x-kvlab-routed-to"] in {"sim-0", "sim-1"}
        status = kvlab("status", env=env)
        assert status.returncode == 0 and "sim-1" in status.stdout
    finally:
        down = kvlab("down", env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert stack is not None
    assert not any(runs_command(pid, argv) for pid, argv in _pids(stack))
    assert kvlab("status", env=env).returncode == 1       # recorded as stopped


@pytest.mark.slow
def test_a_killed_supervisor_takes_its_children_and_down_finds_nothing_left(tmp_path, small_topology):
    env = dict(os.environ, KVLAB_RUNS_DIR=str(tmp_path / "runs"))
    up = kvlab("up", "--topology", str(small_topology), env=env)
    stack = read_info(tmp_path / "runs" / "latest")
    assert stack is not None and stack.supervisor is not None, up.stdout + up.stderr
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        os.kill(stack.supervisor.pid, signal.SIGKILL)   # the kernel SIGTERMs its children (PR_SET_PDEATHSIG)
        deadline = time.monotonic() + 30
        while any(still_running(p) for p in stack.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(still_running(p) for p in stack.processes)
    finally:
        down = kvlab("down", env=env)   # what stack.json lists is checked by start time, nothing reused is hit
    assert "(0 processes signalled)" in down.stdout, down.stdout
    assert not any(runs_command(pid, argv) for pid, argv in _pids(stack))
