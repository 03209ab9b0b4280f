"""The run-level document every run writes: runs/<id>/summary.json (lab, scenarios, notebooks) and
runs/<id>/compare.json (`kvlab compare`), typed like a phase's `Summary`.

Each scenario fills the sections it has (a lab its phases and their comparison, the autoscale
scenario its `autoscale` result, the faults scenario its `outage`, compare and the twin their
workloads and sweeps, the twin its settings) and `write_run` writes it; every reader (the lab's
exit check, the report's mechanism section, compare.html, the notebooks) gets it back from
`read_run`. Every field has a default, so documents written before a field existed read back;
`workload` is the workload's description, or only its name in files lab 02 wrote earlier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from kvlab.compare.results import Row
from kvlab.compare.sweep import Sweep
from kvlab.load.summary import Slo, Summary
from kvlab.stack.state import write_json


class Machine(msgspec.Struct, kw_only=True):
    """Where a local run ran (kvlab doctor's findings)."""

    isa: str | None = None
    isa_source: str | None = None
    cores: int | None = None
    dtype: str | None = None       # the engine's dtype (vllm only)


class ClusterRun(msgspec.Struct, kw_only=True):
    """A run against a kind cluster: where, the replica pods, what each cache reset answered."""

    context: str = ""
    namespace: str = ""
    replica_pods: list[str] = msgspec.field(default_factory=list)
    cache_resets: dict[str, Any] = msgspec.field(default_factory=dict)   # per phase (per workload, router)


class Section(msgspec.Struct, kw_only=True):
    """compare.json `workloads.<w>`: the workload, what the oracle assumed, a row per router."""

    workload: dict[str, Any] = msgspec.field(default_factory=dict)
    oracle_note: str = ""
    routers: list[Row] = msgspec.field(default_factory=list)


class RunDocument(msgspec.Struct, kw_only=True):
    """runs/<id>/summary.json or compare.json; docs/lab.md and docs/compare.md document the keys."""

    id: str = ""
    run_dir: str = ""
    scenario: str | None = None             # "autoscale", "faults"; None: the lab's phases
    command: str | None = None              # compare: the command line
    engine: str | None = None               # None on a cluster
    replicas: int | None = None
    topology: dict[str, Any] | None = None
    workload: dict[str, Any] | str | None = None
    users: int | None = None
    duration_s: float | None = None
    seed: int | None = None
    quick: bool | None = None
    min_requests: int | None = None
    policies: list[str] = msgspec.field(default_factory=list)   # the lab's phases' routers
    routers: list[str] = msgspec.field(default_factory=list)    # compare's routers
    wall_s: float | None = None
    machine: Machine | None = None
    cluster: ClusterRun | None = None
    phases: dict[str, Summary] = msgspec.field(default_factory=dict)
    comparison: dict[str, float | None] = msgspec.field(default_factory=dict)   # last phase against the first
    autoscale: dict[str, Any] | None = None  # scenarios/autoscale.py summarize_autoscale
    outage: dict[str, Any] | None = None     # scenarios/outage.py: the replica lost, its restart, the resumes
    twin: dict[str, Any] | None = None       # kvlab twin: its settings, what the router saw, each run's speed
    workloads: dict[str, Section] = msgspec.field(default_factory=dict)
    slo: Slo | None = None
    sweeps: dict[str, Sweep] = msgspec.field(default_factory=dict)


def write_run(path: Path, doc: RunDocument) -> Path:
    """The one writer of a run document (indented JSON, written atomically)."""
    write_json(path, msgspec.to_builtins(doc))
    return path


def read_run(path: Path) -> RunDocument:
    """A run document, older shapes included."""
    return msgspec.json.decode(path.read_bytes(), type=RunDocument)
