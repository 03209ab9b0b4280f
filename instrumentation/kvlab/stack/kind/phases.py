"""The Gateway API phases in the kind path's plans and in `kvlab lab --cluster`.

`kvlab lab --cluster --policies baseline,gateway-api,llm-d,kv-aware` benches one cluster through
each router in turn, the same workload and seed, every replica's prefix cache reset before each
phase: `baseline` the cache-blind Service (kube-proxy), `gateway-api` Envoy + `kvlab epp`, `llm-d`
Envoy + llm-d's inference scheduler, and any kvlab gateway preset the `kvlab gateway` Deployment
(which serves the policy it was deployed with). `--dry-run` prints the deploy steps and the URL
each phase is benched through, touching nothing. `kvlab compare --cluster` benches the same routers
(compare/cluster.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from kvlab.errors import ConfigError
from kvlab.stack.kind import objects as o
from kvlab.stack.kind import plan
from kvlab.stack.kind.forward import node_port_url
from kvlab.topology import Topology

if TYPE_CHECKING:
    from kvlab.run.phases import PhaseResult


@dataclass(frozen=True, slots=True)
class LabPhase:
    name: str          # the phase's name in the report
    policy: str        # what routes it (a kvlab policy, kube-proxy, llm-d)
    deploy: str        # the `kvlab cluster deploy` phase it needs
    target: str        # forward.cluster_target name (its NodePort)


def lab_plan(policies: list[str] | None, topology: Topology, flag: str = "--policies") -> list[LabPhase]:
    """The phases of `kvlab lab --cluster`; None: the baseline Service, then the deployed gateway.
    A router the cluster does not serve is a ConfigError naming `flag`, the option that named it."""
    policy = topology.gateway.policy
    out = []
    for p in policies or ["baseline", policy]:
        if p == "baseline":
            out.append(LabPhase("baseline-service", "kube-proxy", "baseline", "baseline"))
        elif p == "gateway-api":
            out.append(LabPhase(f"gateway-api-epp-{policy}", policy, "gateway-api", "gateway-api"))
        elif p == "llm-d":
            out.append(LabPhase("llm-d-scheduler", "llm-d", "llm-d", "llm-d"))
        elif p == policy:
            out.append(LabPhase(f"gateway-{p}", p, "gateway", "gateway"))
        else:
            raise ConfigError(f"--cluster {flag}: {p!r} is not deployed: the cluster's gateway serves {policy!r} "
                              f"(its --topology); choose from baseline, gateway-api, llm-d, {policy}")
    return out


def kind_cluster(context: str, namespace: str) -> o.Cluster:
    """The kind cluster behind a kube context (kind names its context `kind-<name>`), for the dry-runs."""
    return o.Cluster(namespace=namespace, name=context.removeprefix("kind-"))


def print_deploy(phases: list[LabPhase], topology: Topology, cluster: o.Cluster, out: IO[str]) -> None:
    """What must be deployed for `phases`: the `kvlab cluster deploy` command and its steps."""
    needed = list(dict.fromkeys(["observability", *(p.deploy for p in phases)]))
    steps = []
    built = False
    for phase in needed:
        steps += plan.deploy(topology, cluster, phase, build=not built)
        built = built or any(s.argv[:2] == ["docker", "build"] for s in steps)
    print(f"deploy ({' '.join(needed)}): kvlab cluster deploy {' '.join(needed)}", file=out)
    plan.print_plan(steps, out, show_manifests=False)


def benched(phase: LabPhase) -> str:
    """What a phase does, as the dry-runs say it."""
    return (f"reset every replica's prefix cache, then bench {node_port_url(phase.target)}/v1 "
            f"(routed by {phase.policy})")


def print_lab_plan(phases: list[LabPhase], topology: Topology, cluster: o.Cluster, out: IO[str]) -> None:
    """The dry-run of `kvlab lab --cluster`: what must be deployed, then what each phase benches."""
    print_deploy(phases, topology, cluster, out)
    for i, p in enumerate(phases, 1):
        print(f"phase {i}/{len(phases)} {p.name}: {benched(p)}", file=out)


def policy_warning(results: Iterable[PhaseResult], policy: str) -> str | None:
    """A warning when the deployed gateway answered with another policy than `policy` (the
    --topology given is not the one deployed); None when it did not."""
    answered = {r.policy for res in results if res.phase.entry == "gateway" for r in res.records if r.policy} - {policy}
    if not answered:
        return None
    return (f"warning: the gateway answered with policy {', '.join(sorted(answered))}, not {policy}: "
            "pass the --topology you deployed")
