"""Nothing of the local stack listens beyond loopback: every TCP/UDP socket of every process it
starts is bound to 127.0.0.1 / ::1, or is a Unix socket. The same check for real vLLM (its engine
core too, and its KV events on a Unix socket), with a dropped client stopping vLLM within seconds, runs
on tests/test_vllm.py's replicas: one vLLM start-up fewer in the suite."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from edge import exposed_sockets
from kvlab.stack.local import LocalStack
from kvlab.topology import load_topology

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`


def _listening(stack: LocalStack) -> int:
    n = 0
    for child in stack.children:
        for p in [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]:
            n += sum(c.status == psutil.CONN_LISTEN for c in p.net_connections(kind="inet"))
    return n


def _topology(tmp: Path) -> Path:
    path = tmp / "sim.yaml"
    path.write_text("name: net-sim\nengine: sim\npools: [{name: replicas, replicas: 1}]\n"
                    "sim: {time_scale: 0.2, num_blocks: 512}\n"
                    "gateway: {policy: kv-aware}\nobservability: {traces: files, prometheus: auto}\n")
    return path


def test_local_stack_with_the_simulator_listens_on_loopback_only(tmp_path):
    with LocalStack(load_topology(_topology(tmp_path)), tmp_path / "run") as stack:
        stack.start()
        assert _listening(stack) >= 2          # the replica and the gateway at least
        assert exposed_sockets({c.name: c.pid for c in stack.children}) == []
