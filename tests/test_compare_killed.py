"""A `kvlab compare` killed mid-run leaves nothing running: SIGTERM stops its stack the ordinary
way, SIGKILL makes the kernel SIGTERM every child (PR_SET_PDEATHSIG); and a stack.json whose
driver died is found and stopped by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import psutil
import pytest

from conftest import require
from kvlab.process import Child, own_record, still_running
from kvlab.stack.base import StackInfo, read_info, stop_left_over
from test_compare import TOPOLOGY, has_vllm_router

PEER = "vllm-router:cache_aware"


def _until(what, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(0.2)
    return None


@pytest.mark.processes
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_compare_killed_mid_run_leaves_no_process(tmp_path, sig):
    require(has_vllm_router(), "vllm-router (pip install 'kvlab[peers]')")
    (tmp_path / "t.yaml").write_text(TOPOLOGY)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "compare", "--topology", str(tmp_path / "t.yaml"),
                             "--policies", PEER, "--duration", "60", "--users", "2", "--run-dir", str(run)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, KVLAB_RUNS_DIR=str(tmp_path / "runs")))
    started = []
    try:
        def peer_recorded():
            info = read_info(run)
            return info is not None and any(p.name == f"router-{PEER}" and still_running(p)
                                            for p in info.processes) and info
        info = _until(peer_recorded, 90)
        assert info, "the peer never showed up in stack.json"
        assert info.driver is not None and info.driver.pid == proc.pid
        started = psutil.Process(proc.pid).children(recursive=True)
        assert {p.pid for p in info.processes} <= {p.pid for p in started}
        os.kill(proc.pid, sig)
        out = proc.communicate(timeout=60)[0].decode()
        if sig == signal.SIGTERM:
            assert proc.returncode == 130, out[-2000:]
        _, alive = psutil.wait_procs(started, timeout=20)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in started:
            if p.is_running():
                p.kill()


@pytest.mark.processes
def test_the_next_run_stops_what_a_dead_driver_left(tmp_path):
    left = Child.start("router-x", [sys.executable, "-c", "import time; time.sleep(60)"], None,
                       die_with_parent=False)
    try:
        driver = msgspec.structs.replace(own_record("driver"), pid=2**22 + 7)   # no such pid: it died
        StackInfo(id="run", run_dir=str(tmp_path), driver=driver, processes=[left.describe()]).write()
        assert stop_left_over(tmp_path) == 1
        assert not left.alive()
        assert read_info(tmp_path).status == "stopped"
        StackInfo(id="run", run_dir=str(tmp_path), driver=own_record("driver"), processes=[]).write()
        assert stop_left_over(tmp_path) == 0     # its driver runs (this test): not left over
    finally:
        left.stop(1)
