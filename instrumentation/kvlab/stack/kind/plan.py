"""What `kvlab cluster` does, as a list of steps built before anything runs.

A plan is data: `--dry-run` prints it (commands and full manifests) and tests check it, and the
runner executes the very same steps. Cluster lifecycle goes through the `kind` binary (and
`docker` for the image and the GPU node setup); everything inside the cluster goes through the
`kubernetes` client (server-side apply, rollout waits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from kvlab.stack.kind import gatewayapi, llmd
from kvlab.stack.kind import manifests as m
from kvlab.stack.kind import objects as o
from kvlab.topology import Topology

KIND_DIR = o.REPO_ROOT / "kind"
DOCKERFILE = KIND_DIR / "images" / "Dockerfile"
GPU_NODE_SCRIPT = KIND_DIR / "gpu-node.sh"

Action = Literal["run", "apply", "rollout", "gpus", "preflight", "note"]


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """One step: a command (`run`), a server-side apply, or a wait on the cluster."""

    action: Action
    what: str                                   # one line a person reads
    argv: list[str] = []                        # run
    manifests: list[dict[str, Any]] = []        # apply
    context: str | None = None                  # kube context (apply, rollout, gpus)
    namespace: str | None = None                # rollout
    kind: str | None = None                     # rollout: Deployment | DaemonSet
    name: str | None = None                     # rollout
    timeout_s: float = 300.0
    topology: Topology | None = None            # preflight
    cluster: o.Cluster | None = None            # preflight

    def describe(self) -> str:
        if self.action == "run":
            return f"run: {' '.join(_quote(a) for a in self.argv)}"
        if self.action == "apply":
            objs = ", ".join(f"{x['kind'].lower()}/{x['metadata']['name']}" for x in self.manifests)
            return f"apply (server-side, context {self.context}): {self.what}: {objs}"
        if self.action == "rollout":
            return (f"wait: {self.kind.lower()}/{self.name} in {self.namespace} rolled out "  # type: ignore[union-attr]
                    f"(context {self.context}, timeout {self.timeout_s:.0f}s)")
        if self.action == "gpus":
            return f"wait: a node reports allocatable nvidia.com/gpu (context {self.context}, timeout {self.timeout_s:.0f}s)"
        if self.action == "preflight":
            return (f"preflight (context {self.context}): GPU slots, nvidia-smi in a pod (pulls the vLLM image), "
                    f"GPU memory, model cache")
        return f"note: {self.what}"


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./:=@,+" for c in arg) else repr(arg)


def kind_config(gpu: bool) -> Path:
    return KIND_DIR / ("gpu.yaml" if gpu else "cpu.yaml")


def gpu_nodes(config_path: Path, cluster_name: str) -> list[str]:
    """Docker container names of the kind nodes that get GPUs (kind names workers NAME-worker, NAME-worker2...)."""
    config = yaml.safe_load(config_path.read_text())
    names, workers = [], 0
    for node in config["nodes"]:
        if node["role"] != "worker":
            continue
        workers += 1
        if (node.get("labels") or {}).get(o.GPU_NODE_LABEL) == "true":
            names.append(f"{cluster_name}-worker" + ("" if workers == 1 else str(workers)))
    return names


def create(cluster: o.Cluster, topology: Topology | None = None) -> list[Step]:
    """kind cluster (CPU or GPU); on GPU, the nvkind-style node setup, RuntimeClass and device plugin
    (time-sliced if the topology shares a GPU between replicas)."""
    config = kind_config(cluster.gpu)
    steps = [
        Step(action="run", what="check kind", argv=["kind", "version"]),
        Step(action="run", what="create the kind cluster",
             argv=["kind", "create", "cluster", "--name", cluster.name, "--config", str(config), "--wait", "180s"]),
    ]
    if not cluster.gpu:
        return steps
    for node in gpu_nodes(config, cluster.name):
        steps += [
            Step(action="run", what=f"copy the GPU node setup script into {node}",
                 argv=["docker", "cp", str(GPU_NODE_SCRIPT), f"{node}:/kvlab-gpu-node.sh"]),
            Step(action="run", what=f"install the NVIDIA container toolkit in {node}, register the nvidia runtime",
                 argv=["docker", "exec", node, "bash", "/kvlab-gpu-node.sh"]),
        ]
    gpu = m.gpu_support(topology.gpu.replicas_per_gpu if topology else 1)
    steps.append(Step(action="apply", what="gpu", manifests=gpu, context=cluster.context))
    steps += [_rollout(x, cluster.context, 300) for x in gpu if x["kind"] in ("Deployment", "DaemonSet")]
    steps.append(Step(action="gpus", what="GPUs schedulable", context=cluster.context, timeout_s=300))
    return steps


def delete(cluster: o.Cluster) -> list[Step]:
    return [Step(action="run", what="delete the kind cluster", argv=["kind", "delete", "cluster", "--name", cluster.name])]


def _rollout(manifest: dict[str, Any], context: str, timeout_s: float) -> Step:
    return Step(action="rollout", what="rollout", context=context, kind=manifest["kind"],
                name=manifest["metadata"]["name"], namespace=manifest["metadata"]["namespace"], timeout_s=timeout_s)


def gateway_api_phases(topology: Topology, cluster: o.Cluster) -> dict[str, list[o.Manifest]]:
    return {"gateway-api": gatewayapi.standalone(topology, cluster),
            "llm-d": llmd.llm_d(topology, cluster),
            "inference-pool": gatewayapi.conformant(topology, cluster)}


def crd_steps(cluster: o.Cluster, phase: str) -> list[Step]:
    """Install the Gateway API and Inference Extension CRDs before a phase that creates their objects."""
    if phase not in ("llm-d", "inference-pool"):
        return []
    return [Step(action="run", what="install CRDs", argv=["kubectl", "--context", cluster.context, "apply",
                                                          "--server-side", "-f", url])
            for url in gatewayapi.CRD_INSTALL]


def image_steps(cluster: o.Cluster) -> list[Step]:
    """Build the kvlab image from the repository and load it into every kind node."""
    return [
        Step(action="run", what="build the kvlab image",
             argv=["docker", "build", "-f", str(DOCKERFILE), "-t", cluster.image, str(o.REPO_ROOT)]),
        Step(action="run", what="load the image into the kind nodes",
             argv=["kind", "load", "docker-image", cluster.image, "--name", cluster.name]),
    ]


def deploy(topology: Topology, cluster: o.Cluster, phase: str, build: bool = True) -> list[Step]:
    """Apply one phase (baseline | gateway | observability) and wait until it has rolled out."""
    rendered = {**m.render(topology, cluster), **gateway_api_phases(topology, cluster)}[phase]
    steps: list[Step] = crd_steps(cluster, phase)
    if build and phase in ("baseline", "gateway", "gateway-api", "inference-pool"):
        steps += image_steps(cluster)
    if phase == "baseline" and cluster.gpu:
        steps.append(Step(action="note", what=(
            f"vLLM reads HF_TOKEN from the Secret {cluster.hf_token_secret!r} (key `token`) if it exists; "
            f"gated models need it: kubectl -n {cluster.namespace} create secret generic "
            f"{cluster.hf_token_secret} --from-file=token=$HOME/.cache/huggingface/token "
            f"(the file `hf auth login` writes; never the token itself on a command line)")))
    if phase == "baseline" and cluster.gpu:
        # clear failures (no GPU slots, image, runtime, memory) before the 30-minute rollout wait
        steps.append(Step(action="preflight", what="preflight", context=cluster.context,
                          topology=topology, cluster=cluster, timeout_s=1200))
    steps.append(Step(action="apply", what=phase, manifests=rendered, context=cluster.context))
    # the first vLLM start downloads the model
    timeout = 1800.0 if cluster.gpu and phase == "baseline" else 300.0
    steps += [_rollout(x, cluster.context, timeout) for x in rendered if x["kind"] in ("Deployment", "DaemonSet")]
    return steps


def print_plan(steps: list[Step], out: Any, show_manifests: bool = True) -> None:
    """The dry-run view: every step, numbered, with the full YAML of what would be applied."""
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step.describe()}", file=out)
        if show_manifests and step.action == "apply":
            print(m.to_yaml(step.manifests).rstrip(), file=out)
            print("...", file=out)
