"""`kvlab up`'s supervisor restarts a dead child with back-off instead of only reporting `degraded`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from kvlab.stack import supervisor
from kvlab.stack.base import read_info
from kvlab.stack.supervisor import Restarter


class FakeChild:
    def __init__(self, name: str) -> None:
        self.name, self.pid, self.proc, self.log, self.up = name, 1, None, Path("x.log"), True

    def alive(self) -> bool:
        return self.up


class FakeStack:
    def __init__(self) -> None:
        self.children = [FakeChild("engine-replicas"), FakeChild("gateway")]
        self.states: list[str] = []
        self.restarted: list[tuple[str, int]] = []

    def write_state(self, status: str) -> None:
        self.states.append(status)

    def restart(self, child: FakeChild, n: int) -> FakeChild:
        new = FakeChild(child.name)
        self.children[self.children.index(child)] = new
        self.restarted.append((child.name, n))
        return new


def test_restarts_back_off_and_reset_once_stable(capsys):
    stack = FakeStack()
    r = Restarter(stack)
    stack.children[0].up = False
    r.check(now=0.0)                         # first restart: at once
    assert stack.restarted == [("engine-replicas", 1)] and stack.states == ["degraded", "running"]
    stack.children[0].up = False
    r.check(now=5.0)                         # second: after 1 s
    assert len(stack.restarted) == 1 and stack.states[-1] == "degraded"
    r.check(now=5.9)
    assert len(stack.restarted) == 1
    r.check(now=6.0)
    assert stack.restarted[-1] == ("engine-replicas", 2) and stack.states[-1] == "running"
    stack.children[0].up = False
    r.check(now=7.0)
    r.check(now=8.9)
    assert len(stack.restarted) == 2         # third: after 2 s
    r.check(now=9.0)
    assert stack.restarted[-1] == ("engine-replicas", 3)
    stack.children[0].up = False             # up for a minute: back to no delay
    r.check(now=9.0 + supervisor.STABLE_S)
    assert stack.restarted[-1] == ("engine-replicas", 1)
    assert "restart 2 in 1 s" in capsys.readouterr().out


@pytest.mark.slow
def test_kvlab_up_restarts_a_killed_engine_and_gateway(tmp_path):
    topo = tmp_path / "small.yaml"
    topo.write_text("name: small\nengine: sim\npools: [{name: replicas, replicas: 2}]\n"
                    "sim: {time_scale: 0.2, num_blocks: 512}\ngateway: {policy: kv-aware}\n"
                    "observability: {traces: \"off\", prometheus: \"off\"}\n")
    env = dict(os.environ, KVLAB_RUNS_DIR=str(tmp_path / "runs"))
    kv = [sys.executable, "-m", "kvlab.cli"]
    up = subprocess.run([*kv, "up", "--topology", str(topo)], env=env, capture_output=True, text=True, timeout=120)
    latest = tmp_path / "runs" / "latest"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        stack = read_info(latest)
        assert stack is not None
        body = {"prompt": "hello there", "max_tokens": 2}
        for name in ("engine-replicas", "gateway"):
            old = next(p for p in stack.processes if p.name == name)
            os.killpg(old.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:
                stack = read_info(latest) or stack
                new = next(p for p in stack.processes if p.name == name)
                if new.pid != old.pid and stack.status == "running":
                    try:
                        if requests.post(f"{stack.gateway}/v1/completions", json=body, timeout=5).status_code == 200:
                            break
                    except requests.ConnectionError:
                        pass
                time.sleep(0.2)
            else:
                pytest.fail(f"{name} not restarted and serving: {(Path(stack.run_dir) / 'supervisor.log').read_text()}")
        log = (Path(stack.run_dir) / "supervisor.log").read_text()
        assert "engine-replicas restarted" in log and "gateway restarted" in log
    finally:
        down = subprocess.run([*kv, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
