"""`kvlab cluster preflight`: what a GPU deploy needs, checked before any rollout wait.

Missing GPUs otherwise surface as Pending pods half an hour into a rollout. The checks, in order:
GPU slots allocatable on the GPU node(s) (the device plugin's, time-sliced per the topology); the
device plugin's slots per GPU against the topology's `replicas_per_gpu` (`sharing`); then
one short-lived pod that asks for a slot, in the vLLM image, and runs `nvidia-smi`: it shows that
the image pulls (and pre-pulls it for the deploy), that the driver and the nvidia runtime reach a
container, and how much memory the GPU has for the topology's slices. Last, the model cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvlab.stack.kind import gpu
from kvlab.stack.kind import objects as o
from kvlab.topology import Topology

PROBE_POD = "kvlab-preflight-nvidia-smi"
PROBE_NAMESPACE = "nvidia-device-plugin"     # made by `kvlab cluster create --gpu`, privileged
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
START_FAILURES = ("CreateContainerError", "CreateContainerConfigError", "RunContainerError", "CrashLoopBackOff")


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str
    fatal: bool = True       # a failed fatal check stops the deploy


def probe_pod(cluster: o.Cluster) -> dict[str, Any]:
    """One GPU slot, the vLLM image, `nvidia-smi` printing each visible GPU's name and memory."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": PROBE_POD, "namespace": PROBE_NAMESPACE, "labels": {o.PART_OF: "kvlab"}},
        "spec": {
            "restartPolicy": "Never", "runtimeClassName": "nvidia", "automountServiceAccountToken": False,
            "nodeSelector": {o.GPU_NODE_LABEL: "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "name": "nvidia-smi", "image": cluster.vllm_image, "imagePullPolicy": "IfNotPresent",
                "command": ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                "resources": {"requests": {"cpu": "10m", "memory": "64Mi"},
                              "limits": {"cpu": "500m", "memory": "256Mi", "nvidia.com/gpu": "1"}},
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "seccompProfile": {"type": "RuntimeDefault"}},
            }],
        },
    }


def gpu_slots(core: Any, topology: Topology) -> Check:
    """Allocatable `nvidia.com/gpu` on the GPU nodes covers every replica (one slot each)."""
    nodes = core.list_node(label_selector=f"{o.GPU_NODE_LABEL}=true").items
    if not nodes:
        return Check("GPU nodes", False, f"no node labelled {o.GPU_NODE_LABEL}=true: "
                     f"`kvlab cluster create --gpu --topology {topology.name}`")
    per_node = {n.metadata.name: int((n.status.allocatable or {}).get("nvidia.com/gpu", "0")) for n in nodes}
    have = sum(per_node.values())
    need = sum(p.replicas * p.data_parallel_size for p in topology.pools)
    shown = ", ".join(f"{k}: {v}" for k, v in per_node.items())
    if have < need:
        hint = ("the device plugin is not running or sees no GPU (kubectl -n nvidia-device-plugin logs ds/nvidia-device-plugin)"
                if have == 0 else f"create the cluster with this topology so the device plugin time-slices "
                f"{topology.gpu.replicas_per_gpu} per GPU, or lower `replicas`")
        return Check("GPU slots", False, f"{need} replicas need {need} nvidia.com/gpu, nodes offer {have} ({shown}): {hint}")
    return Check("GPU slots", True, f"{have} nvidia.com/gpu allocatable ({shown}), {need} needed")


def _waiting(pod: Any) -> tuple[str, str] | None:
    for status in pod.status.container_statuses or []:
        if status.state is not None and status.state.waiting is not None:
            return status.state.waiting.reason or "", status.state.waiting.message or ""
    return None


def _unschedulable(pod: Any) -> str | None:
    for cond in pod.status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            return cond.message or "unschedulable"
    return None


def probe(core: Any, cluster: o.Cluster, topology: Topology, timeout_s: float = 1200.0,
          say: Callable[[str], None] = print, poll_s: float = 2.0) -> list[Check]:
    """Run the nvidia-smi pod; a failure names the part that failed (scheduling, image, runtime)."""
    core.create_namespaced_pod(PROBE_NAMESPACE, probe_pod(cluster))
    try:
        deadline, last = time.monotonic() + timeout_s, ""
        while True:
            pod = core.read_namespaced_pod(PROBE_POD, PROBE_NAMESPACE)
            waiting = _waiting(pod)
            if waiting and waiting[0] in PULL_FAILURES:
                return [Check("image", False, f"{cluster.vllm_image} does not pull: {waiting[0]}: {waiting[1]}")]
            if waiting and waiting[0] in START_FAILURES:
                return [Check("image", True, f"{cluster.vllm_image} pulled"),
                        Check("GPU in a pod", False, f"the container does not start ({waiting[0]}: {waiting[1]}): "
                              "the nvidia runtime or driver is not set up in the GPU node (kind/gpu-node.sh)")]
            reason = _unschedulable(pod)
            if reason:
                return [Check("GPU in a pod", False, f"no node takes a pod asking for one GPU: {reason}")]
            if pod.status.phase in ("Succeeded", "Failed"):
                break
            state = f"{pod.status.phase}{f' ({waiting[0]})' if waiting else ''}"
            if state != last:
                say(f"  nvidia-smi pod: {state}" + (" — pulling the vLLM image (~10 GB) the first time"
                                                      if waiting and waiting[0] == "ContainerCreating" else ""))
                last = state
            if time.monotonic() > deadline:
                return [Check("GPU in a pod", False, f"the nvidia-smi pod is still {state} after {timeout_s:.0f}s")]
            time.sleep(poll_s)
        log = core.read_namespaced_pod_log(PROBE_POD, PROBE_NAMESPACE) or ""
    finally:
        core.delete_namespaced_pod(PROBE_POD, PROBE_NAMESPACE)
    checks = [Check("image", True, f"{cluster.vllm_image} pulled")]
    gpus = [line.rsplit(",", 1) for line in log.strip().splitlines() if "," in line]
    if pod.status.phase == "Failed" or not gpus:
        return checks + [Check("GPU in a pod", False, f"nvidia-smi failed in the pod: {log.strip() or 'no output'}")]
    name, mib = gpus[0][0].strip(), float(gpus[0][1])
    checks.append(Check("GPU in a pod", True, f"nvidia-smi sees {name}, {mib / 1024:.1f} GiB"))
    return checks + [memory(topology, mib / 1024)]


def slots_per_gpu(core: Any) -> int:
    """How many `nvidia.com/gpu` slots the device plugin advertises per physical GPU: the
    time-slicing `replicas` of the config `kvlab cluster create --gpu --topology T` applied, else 1."""
    import yaml
    from kubernetes.client.exceptions import ApiException

    try:
        config = core.read_namespaced_config_map(gpu.DEVICE_PLUGIN_CONFIG, PROBE_NAMESPACE)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return 1
    data = yaml.safe_load((config.data or {}).get("config.yaml") or "{}") or {}
    resources = ((data.get("sharing") or {}).get("timeSlicing") or {}).get("resources") or []
    return max([int(r.get("replicas", 1)) for r in resources if r.get("name") == "nvidia.com/gpu"], default=1)


def sharing(core: Any, topology: Topology) -> Check:
    """Placement on shared GPUs is decided by slot count alone: the kubelet hands every slot (a
    device ID) to one pod at a time, so with R slots per GPU at most R replicas share a GPU, and 4
    replicas on 2 GPUs x 2 slots fill every slot: exactly 2 per GPU. A device plugin time-sliced
    for another topology (gpu-1's 4 slots per GPU on a 2-GPU box) would let 3 or 4 share one GPU,
    whose memory slices then do not fit."""
    have, want = slots_per_gpu(core), topology.gpu.replicas_per_gpu
    if have > want:
        return Check("GPU sharing", False, f"the device plugin offers {have} slots per GPU, {topology.name} is sized "
                     f"for {want} ({topology.gpu.memory_utilization:g} of the memory each): up to {have} replicas "
                     f"could share one GPU. Re-create the cluster: `kvlab cluster create --gpu --topology "
                     f"{topology.name}`")
    return Check("GPU sharing", True, f"{have} slot(s) per GPU: at most {have} replica(s) per GPU")


def memory(topology: Topology, gib: float) -> Check:
    """Each replica's slice (memory_utilization of the GPU) against what the topology was sized for."""
    g = topology.gpu
    slice_gib = g.memory_utilization * gib
    if g.min_gpu_memory_gib is not None and gib < g.min_gpu_memory_gib:
        return Check("GPU memory", False, f"{gib:.1f} GiB per GPU gives each replica {slice_gib:.1f} GiB; "
                     f"{topology.name} is sized for {g.min_gpu_memory_gib:g} GiB GPUs (weights + "
                     f"{g.num_blocks} KV blocks + activations): use a topology with fewer replicas per GPU")
    return Check("GPU memory", True, f"{g.replicas_per_gpu} x {g.memory_utilization:g} of {gib:.1f} GiB "
                 f"= {slice_gib:.1f} GiB per replica")


def model_cache(core: Any, cluster: o.Cluster) -> Check:
    """The persistent model cache (not fatal: the first deploy creates it and downloads the model)."""
    from kubernetes.client.exceptions import ApiException

    try:
        claim = core.read_namespaced_persistent_volume_claim(gpu.MODEL_CACHE_CLAIM, cluster.namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return Check("model cache", False, f"no claim {gpu.MODEL_CACHE_CLAIM} yet: the first deploy creates it "
                     f"and every replica reads {cluster.hf_model} from it after one download", fatal=False)
    return Check("model cache", True, f"{gpu.MODEL_CACHE_CLAIM} {claim.status.phase}, kept across redeploys")


def running_replicas(core: Any, cluster: o.Cluster) -> int:
    """Ready vLLM replica pods already in the namespace (a redeploy)."""
    from kvlab.gateway.discovery.kubernetes import pod_ready

    pods = core.list_namespaced_pod(cluster.namespace, label_selector=o.REPLICA_SELECTOR).items
    return sum(1 for p in pods if pod_ready(p))


def report(checks: list[Check]) -> tuple[bool, list[str]]:
    """(passed, one line per check) — a failed fatal check fails the whole preflight."""
    lines = [f"{'ok ' if c.ok else 'FAIL' if c.fatal else 'note'} {c.name:<13} {c.detail}" for c in checks]
    return all(c.ok or not c.fatal for c in checks), lines


def run(core: Any, cluster: o.Cluster, topology: Topology, say: Callable[[str], None] = print,
        timeout_s: float = 1200.0, poll_s: float = 2.0) -> list[Check]:
    """Every check, stopping at the first fatal failure (later ones would only repeat it)."""
    checks = [gpu_slots(core, topology)]
    if checks[-1].ok:
        checks.append(sharing(core, topology))
    if checks[-1].ok:
        serving = running_replicas(core, cluster)
        if serving:     # a redeploy: they hold the slots the probe would wait for, and show the GPU path works
            checks.append(Check("GPU in a pod", True, f"{serving} vLLM replica pod(s) already serve on the GPUs "
                                "(nvidia-smi probe skipped: it would wait for a slot they hold)"))
        else:
            checks += probe(core, cluster, topology, timeout_s, say, poll_s)
    if all(c.ok or not c.fatal for c in checks):
        checks.append(model_cache(core, cluster))
    return checks
