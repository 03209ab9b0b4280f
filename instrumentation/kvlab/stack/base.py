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

from kvlab.stack.state import write_json


class StackInfo(msgspec.Struct, kw_only=True):
    """runs/<id>/stack.json. `topology` is the full topology locally, `{"name": ...}` for a cluster
    (the cluster runs what `kvlab cluster deploy` deployed); `replicas` are the endpoints a local
    gateway reads; `processes` what `kvlab down` stops."""

    id: str
    run_dir: str
    status: str = "running"                 # starting | running | degraded | stopped
    target: str = "local"                   # local | kind-cpu | kind-gpu | cluster
    topology: dict[str, Any] = msgspec.field(default_factory=dict)
    model: str | None = None
    policy: str | None = None               # the policy of `gateway`
    gateway: str | None = None
    baseline: str | None = None             # a cluster's cache-blind Service
    replicas: list[dict[str, Any]] = msgspec.field(default_factory=list)
    otlp_endpoint: str | None = None
    traces_dir: str | None = None
    prometheus: str | None = None
    jaeger: str | None = None
    grafana: str | None = None
    supervisor: dict[str, Any] | None = None
    context: str | None = None              # a cluster's kube context and namespace
    namespace: str | None = None
    processes: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = msgspec.to_builtins(self)
        return data

    def write(self) -> None:
        write_json(Path(self.run_dir) / "stack.json", self.to_dict())


def read_info(run_dir: Path) -> StackInfo | None:
    """The stack.json of `run_dir` (None: none, or unreadable)."""
    try:
        return msgspec.json.decode((Path(run_dir) / "stack.json").read_bytes(), type=StackInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


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
