"""`AttachedStack`: a stack started elsewhere (`kvlab up`, a kind cluster), known by its stack.json.

What the notebooks drive: each notebook attaches to the stack of runs/latest (`ensure` starts one
with `kvlab up`, or records a deployed kind cluster), and every phase it runs goes through
`kvlab.run.phases.run_phases` like `kvlab lab`'s. A gateway with a policy the stack does not run
is started for the phase (locally; added to Prometheus's targets; recorded in
<run>/notebook-processes.json so a crashed kernel's leftovers can be stopped by pid) and stopped
with `release()`. On kind the cluster path is `ClusterStack`'s: caches reset through the pod proxy,
round-robin is the baseline Service, client spans go to the in-cluster Jaeger.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from shutil import which
from typing import Any

import msgspec

from kvlab.errors import StackError
from kvlab.lifecycle import http_ok
from kvlab.process import Child, ProcessRecord, stop_recorded
from kvlab.stack.base import StackInfo, read_info
from kvlab.stack.launch import HOST, KVLAB, child_env, free_port, gateway_args
from kvlab.stack.local import reset_replicas
from kvlab.stack.state import new_run_dir, set_latest, write_json

TARGETS = ("local", "kind-cpu", "kind-gpu")
PROCESSES_FILE = "notebook-processes.json"


def _kvlab(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVLAB, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, COLUMNS="120"), check=False)


def healthy(info: StackInfo | None) -> bool:
    """A running stack whose gateway (and, locally, every replica) answers /health."""
    if info is None or info.status != "running" or not info.gateway:
        return False
    urls = [info.gateway] + [r.url for r in info.replicas]
    return all(http_ok(f"{u}/health", timeout_s=2.0) for u in urls)


def recorded(run: Path) -> list[ProcessRecord]:
    """The processes a notebook started in `run` and has not stopped yet."""
    try:
        return msgspec.json.decode((run / PROCESSES_FILE).read_bytes(), type=list[ProcessRecord])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return []


def save_recorded(run: Path, entries: list[ProcessRecord]) -> None:
    if run.exists():
        write_json(run / PROCESSES_FILE, msgspec.to_builtins(entries))


def ensure(target: str, topology: str, root: Path, timeout_s: float) -> StackInfo:
    """The stack of <root>/latest when it is healthy and runs `topology`; else a fresh one
    (local: `kvlab up`, stopping a different local topology first; kind: the deployed cluster)."""
    if target not in TARGETS:
        raise StackError(f"TARGET must be one of {', '.join(TARGETS)}, not {target!r}")
    current = read_info(root / "latest")
    if current is not None and current.target == target and current.topology_name == topology \
            and healthy(current):
        return current
    if target != "local":
        return _record_cluster(target, topology, root)
    if current is not None and current.target == "local" and current.status != "stopped":
        stop(Path(current.run_dir))     # another topology, or degraded: never leave orphans
    proc = _kvlab("up", "--topology", topology, "--timeout", str(timeout_s), timeout_s=timeout_s + 30)
    info = read_info(root / "latest")
    if proc.returncode != 0 or info is None or not healthy(info):
        raise StackError(f"kvlab up failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return _wait_prometheus(info)


def _wait_prometheus(info: StackInfo, timeout_s: float = 20.0) -> StackInfo:
    """`kvlab up` returns once the gateway is healthy; Prometheus (if installed) comes right after."""
    if which("prometheus") is None or info.topology is None or info.topology.observability.prometheus == "off":
        return info
    deadline = time.monotonic() + timeout_s
    while not info.prometheus and time.monotonic() < deadline:
        time.sleep(0.3)
        info = read_info(Path(info.run_dir)) or info
    return info


def _record_cluster(target: str, topology: str, root: Path) -> StackInfo:
    """A stack.json for the deployed kind cluster (its published URLs; the model it serves)."""
    from kvlab.stack.kind.cluster import ClusterStack

    run_dir = new_run_dir(target, root)
    cluster = ClusterStack(run_dir, target=target, topology=topology, policy="kv-aware", export_spans=False)
    cluster.url("gateway")
    cluster.url("baseline")
    info = msgspec.structs.replace(cluster.describe(), model=cluster.served_model())
    info.write()
    set_latest(run_dir)
    return info


def stop(run: Path) -> None:
    """`kvlab down` for a local run dir plus any process a notebook recorded there."""
    for entry in recorded(run):
        stop_recorded(entry)
    save_recorded(run, [])
    info = read_info(run)
    if info is not None and info.target == "local":
        _kvlab("down", "--run-dir", str(run))


class AttachedStack:
    """A `Stack` over a stack.json; it stops only the gateways it started itself."""

    def __init__(self, info: StackInfo) -> None:
        self.info = info
        self.run = Path(info.run_dir)
        self._extra: tuple[Child, str] | None = None      # (a gateway started here, its host:port)
        self._cluster: Any = None                          # ClusterStack on kind targets
        if info.target != "local":
            from kvlab.stack.kind.cluster import ClusterStack

            self._cluster = ClusterStack(self.run, info.context or "kind-kvlab", info.namespace or "kvlab",
                                         target=info.target, policy=info.policy, warn=print)   # in the cell's output

    @property
    def otlp_endpoint(self) -> str | None:
        return self._cluster.otlp_endpoint if self._cluster is not None else self.info.otlp_endpoint

    def start(self) -> None:
        if self._cluster is not None:
            self._cluster.start()

    def reset_caches(self) -> dict[str, str | None]:
        """Locally POST /reset_prefix_cache on every replica; on kind through the pod proxy."""
        if self._cluster is not None:
            result: dict[str, str | None] = self._cluster.reset_caches()
            return result
        return reset_replicas(self.info.replicas)

    def gateway_for(self, policy: str, fresh: bool = True, entry: str | None = None) -> str:
        """The stack's own gateway when its policy matches; on kind the baseline Service for
        round-robin; locally, else, a `kvlab gateway` started until `release()`."""
        self.release()
        if self._cluster is not None and entry is not None:
            url: str = self._cluster.gateway_for(policy, fresh, entry)
            return url
        if self.info.policy == policy and self.info.gateway:
            return self.info.gateway
        if self._cluster is not None:
            if policy != "round-robin":
                raise StackError(f"on {self.info.target} the cluster serves round-robin (baseline) and "
                                 f"{self.info.policy} (gateway), not {policy}")
            return self.info.baseline or self._cluster.url("baseline")
        return self._start_gateway(policy)

    def _start_gateway(self, policy: str) -> str:
        port = free_port()
        ready = self.run / f"ready-gateway-{policy}.json"
        ready.unlink(missing_ok=True)
        topology = self.info.topology
        if topology is None:
            raise StackError(f"stack {self.info.id} records no topology to start a gateway from")
        g = topology.gateway
        argv = [*KVLAB, *gateway_args(g, policy=policy, model=self.info.model or topology.model, host=HOST,
                                      port=port, config=g.config, tokenizer=topology.tokenizer),
                "--endpoints-file", str(self.run / "endpoints.json"), "--ready-file", str(ready)]
        env = child_env("kvlab-gateway", self.info.otlp_endpoint, topology.observability.sample_ratio)
        child = Child.start(f"gateway-{policy}", argv, self.run / "logs" / f"gateway-{policy}.log", env)
        hostport = f"{HOST}:{port}"
        self._extra = (child, hostport)
        save_recorded(self.run, [*recorded(self.run), child.describe()])
        child.wait_ready_file(ready, 60)
        url = f"http://{hostport}"
        child.wait_http(f"{url}/health", 60)
        self._scrape(hostport, add=True)
        return url

    def release(self) -> None:
        """Stop the gateway `gateway_for` started here, if any."""
        if self._extra is None:
            return
        child, hostport = self._extra
        self._extra = None
        child.stop()
        save_recorded(self.run, [e for e in recorded(self.run) if e.pid != child.pid])
        self._scrape(hostport, add=False)

    def _scrape(self, hostport: str, add: bool) -> None:
        """Add (remove) a gateway to the `gateway` job of the stack's Prometheus (file-based service
        discovery, no reload), so the dashboards show every policy a notebook ran."""
        from kvlab.stack.prometheus import targets_file, write_targets

        path = targets_file(self.run, "gateway")
        if not self.info.prometheus or not path.is_file():
            return
        targets = [t for group in json.loads(path.read_text()) for t in group.get("targets", [])]
        targets = [t for t in targets if t != hostport] + ([hostport] if add else [])
        write_targets(self.run, "gateway", targets)

    def describe(self) -> StackInfo:
        return self.info

    def stop(self) -> None:
        """Stop what was started here (the stack itself keeps running)."""
        self.release()
        if self._cluster is not None:
            self._cluster.stop()
