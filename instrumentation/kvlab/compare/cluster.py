"""`kvlab compare --cluster`: the routers of a kind cluster that `kvlab cluster deploy` deployed.

A cluster's routers are its front doors (stack/kind/phases.py): `baseline` the cache-blind Service
(kube-proxy), `gateway-api` Envoy + `kvlab epp`, `llm-d` Envoy + llm-d's inference scheduler, and
the deployed `kvlab gateway` under the policy it serves. `ClusterStack` puts them in front of the
same `measure` loop as a local stack. Nothing is started: a router kvlab would start here (a
vllm-router peer, a `--router` command) runs on this machine and cannot reach the pods' IPs, and
the replicas are what was deployed.
"""

from __future__ import annotations

import argparse
from typing import IO

from kvlab.errors import ConfigError
from kvlab.load.spec import BenchSpec
from kvlab.run.routers import Router, unique
from kvlab.stack.kind.phases import LabPhase, benched, kind_cluster, lab_plan, print_deploy
from kvlab.topology import Topology

LOCAL_ONLY = {"engine": "--engine", "replicas": "--replicas", "router": "--router"}


def default_routers(topology: Topology) -> str:
    """Every router a cluster can serve: kube-proxy, Envoy + kvlab epp, llm-d, the kvlab gateway."""
    return f"baseline,gateway-api,llm-d,{topology.gateway.policy}"


def refuse_local(args: argparse.Namespace) -> None:
    """A ConfigError naming the local-only flags given with `--cluster`."""
    given = [flag for key, flag in LOCAL_ONLY.items() if getattr(args, key) not in (None, [])]
    if given:
        raise ConfigError(f"--cluster runs what `kvlab cluster deploy` deployed; {', '.join(given)}: only for a "
                          "local compare, which starts its own replicas and routers (deploy another --topology "
                          "to change the cluster's)")


def cluster_routers(names: list[str], topology: Topology) -> list[tuple[Router, LabPhase]]:
    """The routers `names` name on the cluster, each with the phase that benches it (`lab_plan`
    validates them); a peer kvlab would start here is a ConfigError."""
    peers = [n for n in names if n.startswith("vllm-router:")]
    if peers:
        raise ConfigError(f"--cluster: {', '.join(peers)}: kvlab starts peers as local processes, which cannot "
                          f"reach the cluster's pod IPs; its routers are {default_routers(topology)}")
    phases = lab_plan(unique(names), topology, flag="--policies")
    return [(Router(name, policy=p.policy, entry=p.target), p) for name, p in zip(names, phases, strict=True)]


def print_plan(planned: list[tuple[Router, LabPhase]], topology: Topology, specs: dict[str, BenchSpec],
               args: argparse.Namespace, out: IO[str]) -> None:
    """`--cluster --dry-run`: what must be deployed, then what each router benches, per workload."""
    print_deploy([p for _, p in planned], topology, kind_cluster(args.context, args.namespace), out)
    first = next(iter(specs.values()))
    print(f"per workload ({', '.join(specs)}; seed {first.seed}, {first.users} users, {first.duration_s:.0f} s "
          f"per router), on the ready replica pods of {args.context}/{args.namespace}:", file=out)
    for i, (router, phase) in enumerate(planned, 1):
        print(f"router {i}/{len(planned)} {router.name}{' (peer)' if router.peer else ''}: {benched(phase)}",
              file=out)
