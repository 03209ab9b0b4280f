"""What a stack is to the run pipeline, and the one document that describes it (stack.json).

A `Stack` is whatever serves the lab's model behind a gateway: processes on this machine
(`LocalStack`), a kind cluster (`ClusterStack`) or a stack started elsewhere and known only by
its stack.json (`AttachedStack`, what the notebooks use). `kvlab.run.phases.run_phases` drives any
of them the same way: reset the caches, ask for a gateway with a policy, run the load.
`StackInfo` is stack.json (contract 3): every writer fills it, every reader parses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import msgspec

from kvlab.contract import Endpoint
from kvlab.errors import ConfigError
from kvlab.lifecycle import write_atomic
from kvlab.process import ProcessRecord, still_running, stop_recorded
from kvlab.topology import Topology


class StackInfo(msgspec.Struct, kw_only=True, frozen=True):
    """runs/<id>/stack.json. `topology` is the full topology of a local stack; a cluster runs what
    `kvlab cluster deploy` deployed and records only its name (`deployed`); `replicas` are the
    endpoints a local gateway reads; `processes` what `kvlab down` stops (after `supervisor`), and
    what a later lab or compare stops when `driver` died without stopping them."""

    id: str
    run_dir: str
    status: str = "running"                 # starting | running | degraded | stopped
    target: str = "local"                   # local | kind-cpu | kind-gpu | cluster
    topology: Topology | None = None
    deployed: str | None = None             # a cluster's topology name
    model: str | None = None
    policy: str | None = None               # the policy of `gateway`
    gateway: str | None = None
    baseline: str | None = None             # a cluster's cache-blind Service
    replicas: list[Endpoint] = msgspec.field(default_factory=list)
    otlp_endpoint: str | None = None
    traces_dir: str | None = None
    prometheus: str | None = None
    jaeger: str | None = None
    grafana: str | None = None
    supervisor: ProcessRecord | None = None
    driver: ProcessRecord | None = None     # the kvlab lab/compare that runs the stack in-process
    context: str | None = None              # a cluster's kube context and namespace
    namespace: str | None = None
    processes: list[ProcessRecord] = msgspec.field(default_factory=list)

    @property
    def topology_name(self) -> str | None:
        """The topology the stack runs, local or deployed."""
        return self.topology.name if self.topology is not None else self.deployed

    def write(self) -> None:
        """runs/<id>/stack.json, atomically (readers never see half a file)."""
        write_atomic(Path(self.run_dir) / "stack.json", msgspec.json.format(msgspec.json.encode(self)).decode() + "\n")


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A stack.json from before the nested parts were typed, in today's shape: a cluster's
    `topology: {"name": ...}` is `deployed`; the supervisor was recorded without name and log."""
    topology = data.get("topology")
    if isinstance(topology, dict) and set(topology) <= {"name"}:
        data = {**data, "topology": None, "deployed": data.get("deployed") or topology.get("name")}
    if isinstance(data.get("supervisor"), dict):
        data = {**data, "supervisor": {"name": "supervisor", **data["supervisor"]}}
    return data


def read_info(run_dir: Path) -> StackInfo | None:
    """The stack.json of `run_dir`, written by this version or an earlier one (None: none, or
    unreadable): the one reader of stack.json. A topology today's `Topology` no longer accepts (an
    older version's settings) is dropped, its name kept in `deployed`, so `kvlab down` still finds
    the processes to stop."""
    try:
        data = msgspec.json.decode((Path(run_dir) / "stack.json").read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    if not isinstance(data, dict):
        return None
    data = _upgrade(data)
    try:
        return msgspec.convert(data, StackInfo)
    except (msgspec.ValidationError, ConfigError):
        if not isinstance(data.get("topology"), dict):
            return None
    try:
        return msgspec.convert({**data, "topology": None, "deployed": data["topology"].get("name")}, StackInfo)
    except msgspec.ValidationError:
        return None


def stop_left_over(run_dir: Path) -> int:
    """Stop the processes a `kvlab lab` or `kvlab compare` killed mid-run left in run_dir's stack.json
    (its `driver` no longer runs); how many were still running."""
    info = read_info(run_dir)
    if info is None or info.driver is None or info.status == "stopped" \
            or still_running(info.driver):
        return 0
    stopped = sum(stop_recorded(p) for p in reversed(info.processes))
    msgspec.structs.replace(info, status="stopped", processes=[]).write()
    return stopped


class Stack(Protocol):
    """The seam between the run pipeline and what serves the requests (docs/architecture.md)."""

    @property
    def otlp_endpoint(self) -> str | None:
        """Where the load generator's client spans go (None: nowhere)."""
        ...

    def start(self) -> None:
        """Bring the stack up (a no-op for one that is already running elsewhere)."""

    def gateway_for(self, policy: str, fresh: bool = True, entry: str | None = None) -> str:
        """Base URL of a gateway routing with `policy`; `fresh`: a new gateway (no routing state
        left from an earlier phase) where the stack can start one; `entry`: which front door of a
        stack that has several (a cluster's baseline, gateway, gateway-api, llm-d), else by policy."""
        ...

    def reset_caches(self) -> dict[str, str | None]:
        """Empty every replica's prefix cache: {replica: None if reset, else why not}."""
        ...

    def describe(self) -> StackInfo:
        """The stack's stack.json."""
        ...

    def stop(self) -> None:
        """Stop what this object started (never a stack it only attached to)."""
