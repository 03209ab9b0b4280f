"""Workloads as a plug-in family: a base (`base.py`) and one module per workload.

`create(name, seed, params)` builds one; modules are imported only when asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvlab.errors import ConfigError
from kvlab.load.workloads.base import Workload, WorkloadRequest

__all__ = ["NAMES", "Workload", "WorkloadRequest", "create", "workload_class"]

# workload name -> module that defines it (class attribute `name` must match)
_MODULES = {
    "shared-prefix": "kvlab.load.workloads.shared_prefix",
    "multi-turn": "kvlab.load.workloads.multi_turn",
    "long-doc-qa": "kvlab.load.workloads.long_doc_qa",
    "random": "kvlab.load.workloads.random",
    "pd-mix": "kvlab.load.workloads.pd_mix",
    "agentic": "kvlab.load.workloads.agentic",
    "long-context": "kvlab.load.workloads.long_context",
    "chunked-mix": "kvlab.load.workloads.chunked_mix",
    "trace": "kvlab.load.workloads.trace",
}
NAMES = tuple(_MODULES)


def workload_class(name: str) -> type[Workload[Any]]:
    """The Workload subclass registered under `name`."""
    if name not in _MODULES:
        raise ConfigError(f"unknown workload {name!r}; choose one of: {', '.join(NAMES)}")
    module = importlib.import_module(_MODULES[name])
    return next(obj for obj in vars(module).values()
                if isinstance(obj, type) and issubclass(obj, Workload) and getattr(obj, "name", None) == name)


def create(name: str, seed: int = 0, params: dict[str, Any] | None = None) -> Workload[Any]:
    """A workload by name, its parameters validated (unknown keys are errors)."""
    return workload_class(name)(seed=seed, params=params)
