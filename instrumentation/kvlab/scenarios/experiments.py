"""The experiments of lab 10 (docs/experiments.md): each moves one number on the simulator.

Each is a topology under labs/topologies/, run with `kvlab lab --topology T --policies A,B
--quick`; lab 10 runs them one stack each and its checkpoints assert the direction of every effect
with the measures below. They are counts and shares of what the engines and the gateway reported
(hit rates, predicted − delivered tokens, requests per replica), so a busy machine slows the
phases but does not turn an effect around; only the users ladder reads latencies, with wide margins.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvlab.load.measure import Record
from kvlab.load.summary import Summary
from kvlab.topology import Topology, load_topology, resolve_topology

# topology -> the policies it compares, first the one the effect is measured against
EXPERIMENTS = {
    "control": ("round-robin", "kv-aware"),
    "cache-sweep": ("round-robin", "kv-aware"),
    "hot-group": ("kv-aware-affinity", "kv-aware"),
    "eviction": ("prefix", "kv-aware"),
    "users-ladder": ("round-robin", "kv-aware"),
}


def topology(name: str) -> Topology:
    """A shipped experiment's topology."""
    return load_topology(resolve_topology(name))


def variant(name: str, out_dir: Path, **sim: Any) -> Path:
    """The topology `name` with these `sim:` settings changed (a point of a sweep), written as
    <out_dir>/<name>-<values>.yaml under its own name so `kvlab up` and `kvlab lab` tell it apart."""
    base = topology(name)
    changed = msgspec.structs.replace(base, sim=msgspec.structs.replace(base.sim, **sim))
    label = f"{name}-{'-'.join(str(v) for v in sim.values())}"
    data = msgspec.to_builtins(msgspec.structs.replace(changed, name=label))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{label}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def delivered(summary: Summary) -> float:
    """The share of prompt tokens the engines served from cache."""
    return summary.hit_rate.delivered or 0.0


def warm_delivered(records: list[Record]) -> float:
    """The delivered hit rate without the compulsory misses: over the requests that are not the
    first of their group on their replica (a first visit finds nothing under any cache size), so a
    short phase measures what the cache size decides, not how many groups it had time to warm."""
    seen: set[tuple[str, str]] = set()
    cached = prompt = 0
    for r in sorted(records, key=lambda r: r.ts):
        if r.error or not r.prompt_tokens:
            continue
        pair = (r.group, r.replica or "")
        if pair in seen:
            cached += r.cached_tokens or 0
            prompt += r.prompt_tokens
        seen.add(pair)
    return cached / prompt if prompt else 0.0


def undelivered(summary: Summary) -> float:
    """predicted − delivered: the share of prompt tokens the gateway routed for as cached that the
    replica had to recompute (evicted, or never there)."""
    return (summary.hit_rate.predicted or 0.0) - (summary.hit_rate.delivered or 0.0)


def busiest_share(summary: Summary) -> float:
    """The share of the phase's successful requests the busiest replica served."""
    counts = summary.replicas
    return max(counts.values()) / sum(counts.values()) if counts else 0.0


def group_replicas(records: list[Record], group: str) -> dict[str, float]:
    """Which replicas served `group`, as shares of its successful requests (largest first)."""
    counts = Counter(r.replica or "?" for r in records if r.group == group and not r.error)
    total = sum(counts.values())
    return {name: n / total for name, n in counts.most_common()}
