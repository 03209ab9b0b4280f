"""`kvlab cluster`: the kind path.

    kvlab cluster create [--gpu] [--topology NAME|FILE]   kind cluster (+ GPU node setup, device plugin)
    kvlab cluster deploy baseline|gateway|observability [--gpu] [--topology NAME|FILE]
    kvlab cluster render baseline|gateway|observability [--gpu] [--topology NAME|FILE] --manifests-dir DIR
    kvlab cluster preflight [--topology NAME|FILE]   GPU slots, nvidia-smi in a pod, image, memory, model cache
    kvlab cluster status                         deployments, pods and the URLs to use
    kvlab cluster forward [TARGET ...]           port-forwards (gateway, jaeger, prometheus, grafana)
    kvlab cluster delete

`--dry-run` prints every step and every manifest without touching anything.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvlab import __version__
from kvlab.errors import KvlabError
from kvlab.stack.kind import forward, plan, versions
from kvlab.stack.kind import manifests as m
from kvlab.stack.kind import objects as o
from kvlab.stack.kind.runner import api_client
from kvlab.topology import Topology, builtin, load_topology
from kvlab.vocabulary import old_spelling

# `kvlab cluster ACTION`: what each does (`kvlab --help` lists the names)
ACTIONS = {
    "create": "a kind cluster (+ GPU node setup)",
    "deploy": "apply baseline|gateway|observability|gateway-api|llm-d|inference-pool",
    "render": "write what deploy would apply, as YAML",
    "preflight": "check GPU slots, an nvidia-smi pod, the image, memory",
    "status": "deployments, pods and the URLs to use",
    "forward": "port-forward gateway, jaeger, prometheus, grafana",
    "delete": "delete the kind cluster",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=ACTIONS, help="; ".join(f"{name}: {what}" for name, what in ACTIONS.items()))
    p.add_argument("what", nargs="*", help="deploy, render: baseline|gateway|observability|gateway-api|llm-d|inference-pool; forward: targets")
    p.add_argument("--gpu", action="store_true", help="GPU host: vLLM replicas on NVIDIA GPUs (kind/gpu.yaml)")
    p.add_argument("--name", default="kvlab", help="kind cluster name (kube context kind-NAME)")
    p.add_argument("--namespace", default="kvlab", help="the namespace kvlab deploys into (default kvlab)")
    p.add_argument("--topology", default=None,
                   help="a shipped topology name or a YAML file (default: quickstart; with --gpu: the gpu-N fitting the host's GPUs)")
    p.add_argument("--image", default=f"kvlab:{__version__}", help="the kvlab image (gateway + simulator)")
    p.add_argument("--no-build", action="store_true", help="deploy: do not build/load the kvlab image")
    p.add_argument("--hf-model", default=None,
                   help=f"GPU: the Hugging Face model vLLM serves (default: the topology's gpu.model, else {versions.VLLM_MODEL})")
    p.add_argument("--manifests-dir", type=Path, help="render: the directory the YAML files are written to")
    old_spelling(p, "--out", "--manifests-dir", type=Path)
    p.add_argument("--dry-run", action="store_true", help="print the steps and manifests; touch nothing")
    return p


GPU_TOPOLOGIES = {1: "gpu-1", 2: "gpu-2", 4: "gpu-4"}   # shipped, each capping the KV cache
_CHOOSE = "--topology " + "|".join(GPU_TOPOLOGIES.values())


def host_gpus() -> int:
    """NVIDIA GPUs on this host (kind's nodes share them): `nvidia-smi -L`, 0 when it is missing."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


def gpu_default(args: argparse.Namespace) -> str:
    """`--gpu` with no topology: the shipped gpu-N fitting the host's GPUs for a real create/deploy;
    render and --dry-run touch nothing, so they ask for one. Never the uncapped quickstart."""
    if args.action == "render" or args.dry_run:
        raise KvlabError(f"{args.action} --gpu: name the GPU topology, {_CHOOSE} "
                         "(1, 2 or 4+ GPUs; docs/kind.md, \"GPU host, end to end\")")
    n = host_gpus()
    if n < 1:
        raise KvlabError(f"{args.action} --gpu: no NVIDIA GPU found (nvidia-smi -L); "
                         f"on a GPU host choose {_CHOOSE} by its GPU count")
    name = GPU_TOPOLOGIES[max(k for k in GPU_TOPOLOGIES if k <= n)]
    print(f"kvlab cluster: --gpu with no --topology: {n} GPU(s) found, using --topology {name}", file=sys.stderr)
    return name


def _topology(spec: str) -> Topology:
    path = Path(spec)
    return load_topology(path if path.suffix in (".yaml", ".yml") else builtin(spec))


def topology_for(args: argparse.Namespace) -> Topology:
    """The topology the command renders; on GPU one that caps the KV cache (the lab's lever:
    uncapped, vLLM takes most of the GPU and every prompt group fits on every replica)."""
    if args.topology is None:
        args.topology = gpu_default(args) if args.gpu else "quickstart"
    topology = _topology(args.topology)
    if args.gpu and topology.gpu.num_blocks is None:
        raise KvlabError(f"topology {topology.name} does not cap the KV cache on GPU (no gpu.num_blocks): "
                         f"use {_CHOOSE}, or add a gpu: section with num_blocks")
    return topology


def _cluster(args: argparse.Namespace, topology: Topology) -> o.Cluster:
    hf_model = args.hf_model or topology.gpu.model or versions.VLLM_MODEL
    return o.Cluster(name=args.name, namespace=args.namespace, gpu=args.gpu, image=args.image, hf_model=hf_model)


def _phases(args: argparse.Namespace) -> list[str]:
    phases = args.what or ["observability", "baseline", "gateway"]
    unknown = [x for x in phases if x not in m.PHASES]
    if unknown:
        raise KvlabError(f"{args.action}: unknown phase(s) {unknown}; choose from {', '.join(m.PHASES)}")
    return phases


def build_plan(args: argparse.Namespace) -> list[plan.Step]:
    topology = topology_for(args)
    cluster = _cluster(args, topology)
    if args.action == "create":
        return plan.create(cluster, topology)
    if args.action == "delete":
        return plan.delete(cluster)
    phases = _phases(args)
    steps: list[plan.Step] = []
    built = False
    for phase in phases:
        steps += plan.deploy(topology, cluster, phase, build=not args.no_build and not built)
        built = built or (not args.no_build and phase in ("baseline", "gateway", "gateway-api", "inference-pool"))
    return steps


def _name(obj: Any) -> str:
    """A Kubernetes object's name (the client types every field optional)."""
    return str(obj.metadata.name) if obj.metadata and obj.metadata.name else "-"


def status(args: argparse.Namespace) -> int:
    from kubernetes import client

    api = api_client(f"kind-{args.name}")
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    deployments = apps.list_namespaced_deployment(args.namespace, label_selector=f"{o.PART_OF}=kvlab").items
    if not deployments:
        print(f"nothing deployed in namespace {args.namespace}: `kvlab cluster deploy`")
        return 1
    print(f"{'DEPLOYMENT':<24} {'READY':>7}  IMAGE")
    for d in sorted(deployments, key=_name):
        ready = f"{d.status.ready_replicas or 0 if d.status else 0}/{d.spec.replicas if d.spec else '?'}"
        containers = d.spec.template.spec.containers if d.spec and d.spec.template.spec else []
        print(f"{_name(d):<24} {ready:>7}  {containers[0].image if containers else '-'}")
    pods = core.list_namespaced_pod(args.namespace, label_selector=f"{o.PART_OF}=kvlab").items
    print(f"\n{'POD':<44} {'PHASE':<10} {'IP':<16} NODE")
    for pod in sorted(pods, key=_name):
        phase, ip = (pod.status.phase, pod.status.pod_ip) if pod.status else (None, None)
        node = pod.spec.node_name if pod.spec else None
        print(f"{_name(pod):<44} {phase or '-':<10} {ip or '-':<16} {node or '-'}")
    services = {_name(svc) for svc in core.list_namespaced_service(args.namespace).items}
    print("\nURLs (NodePorts published on 127.0.0.1 by kind/*.yaml):")
    for target, (service, _, path) in forward.SERVICES.items():
        if service in services:
            print(f"  {target:<11} {forward.node_port_url(target)}{path if path != '/' else ''}")
    return 0


def forward_cmd(args: argparse.Namespace) -> int:
    targets = args.what or ["gateway", "jaeger", "prometheus", "grafana"]
    opened = []
    try:
        for target in targets:
            if target not in forward.SERVICES:
                raise KvlabError(f"forward: unknown target {target!r}; choose from {', '.join(forward.SERVICES)}")
            fwd = forward.open_forward(target, f"kind-{args.name}", args.namespace)
            opened.append(fwd)
            print(f"{target:<11} {fwd.url}{forward.SERVICES[target][2] if forward.SERVICES[target][2] != '/' else ''}"
                  f"  -> {fwd.pod}:{fwd.port}", flush=True)
        print("forwarding; Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        for fwd in opened:
            fwd.close()


def preflight_cmd(args: argparse.Namespace) -> int:
    """GPU clusters: every check `deploy --gpu` relies on, failing clearly before a rollout wait."""
    from kubernetes import client

    from kvlab.stack.kind import preflight

    topology = topology_for(args)
    cluster = _cluster(args, topology)
    core = client.CoreV1Api(api_client(cluster.context))
    passed, lines = preflight.report(preflight.run(core, cluster, topology))
    print("\n".join(lines))
    return 0 if passed else 1


def render_cmd(args: argparse.Namespace) -> int:
    """Write what `deploy` would apply (plan.deploy's very manifests), one YAML file per phase."""
    if args.manifests_dir is None:
        raise KvlabError("render: --manifests-dir DIR is required")
    steps = build_plan(args)
    args.manifests_dir.mkdir(parents=True, exist_ok=True)
    for step in steps:
        if step.action == "apply":
            path = args.manifests_dir / f"{step.what}.yaml"
            path.write_text(m.to_yaml(step.manifests))
            print(f"{path}  ({len(step.manifests)} objects)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.action == "render":
            args.no_build = True
            return render_cmd(args)
        if args.action in ("create", "delete", "deploy"):
            steps = build_plan(args)
            if args.dry_run:
                plan.print_plan(steps, sys.stdout)
                return 0
            from kvlab.stack.kind.runner import Runner

            Runner().run(steps)
            return 0
        if args.action == "preflight":
            args.gpu = True
            if args.dry_run:
                print("preflight: reads the GPU nodes and runs one nvidia-smi pod; nothing to plan")
                return 0
            return preflight_cmd(args)
        if args.dry_run:
            print(f"{args.action}: reads the cluster only; nothing to plan")
            return 0
        return status(args) if args.action == "status" else forward_cmd(args)
    except KvlabError as exc:
        print(f"kvlab cluster: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        if exc.name != "kubernetes":
            raise
        print("kvlab cluster: needs the kubernetes client: pip install 'kvlab[cluster]'", file=sys.stderr)
        return 1
