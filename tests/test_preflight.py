"""`kvlab cluster preflight` against a fake CoreV1Api serving real kubernetes objects: each way a
GPU box can be unready (no GPU node, too few slots, image not pullable, runtime missing, GPU too
small) is named before any rollout wait; a ready box passes and the probe pod is cleaned up."""

from __future__ import annotations

import pytest

pytest.importorskip("kubernetes")
from kubernetes.client import (
    V1ConfigMap,
    V1ContainerState,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Node,
    V1NodeList,
    V1NodeStatus,
    V1ObjectMeta,
    V1PersistentVolumeClaim,
    V1PersistentVolumeClaimStatus,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from kvlab.stack.kind import preflight, versions
from kvlab.stack.kind.manifests import gpu_support
from kvlab.stack.kind.objects import GPU_NODE_LABEL, REPLICA_SELECTOR, Cluster
from kvlab.topology import builtin, load_topology

GPU1 = load_topology(builtin("gpu-1"))          # 4 replicas, 4 slots on one GPU, sized for 22 GiB


def _plugin_config(topology) -> dict[str, str]:
    """The device plugin ConfigMap `kvlab cluster create --gpu --topology T` applies, as rendered."""
    (config,) = [x for x in gpu_support(topology.gpu.replicas_per_gpu) if x["kind"] == "ConfigMap"]
    return config["data"]


def _node(name: str, gpus: str | None) -> V1Node:
    return V1Node(metadata=V1ObjectMeta(name=name, labels={GPU_NODE_LABEL: "true"}),
                  status=V1NodeStatus(allocatable={"cpu": "16", **({"nvidia.com/gpu": gpus} if gpus else {})}))


def _pod(phase: str, waiting: str | None = None, unschedulable: str | None = None) -> V1Pod:
    statuses = [V1ContainerStatus(name="nvidia-smi", image=versions.VLLM_IMAGE, image_id="", ready=False,
                                  restart_count=0, state=V1ContainerState(
                                      waiting=V1ContainerStateWaiting(reason=waiting, message=f"{waiting} detail")))
                ] if waiting else None
    conditions = [V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                                 message=unschedulable)] if unschedulable else None
    return V1Pod(metadata=V1ObjectMeta(name=preflight.PROBE_POD),
                 status=V1PodStatus(phase=phase, container_statuses=statuses, conditions=conditions))


class FakeCore:
    def __init__(self, nodes: list[V1Node], pods: list[V1Pod], log: str = "", claim: bool = False,
                 plugin_config: dict[str, str] | None = None) -> None:
        self.nodes, self.pods, self.log, self.claim = nodes, list(pods), log, claim
        self.plugin_config = plugin_config if plugin_config is not None else _plugin_config(GPU1)
        self.replicas: list[V1Pod] = []     # vLLM replica pods already running (a redeploy)
        self.created: list[dict] = []
        self.deleted: list[str] = []

    def list_node(self, label_selector: str = "", **_) -> V1NodeList:
        assert label_selector == f"{GPU_NODE_LABEL}=true"
        return V1NodeList(items=self.nodes)

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **_) -> V1PodList:
        assert (namespace, label_selector) == ("kvlab", REPLICA_SELECTOR)
        return V1PodList(items=self.replicas)

    def create_namespaced_pod(self, namespace: str, body: dict, **_) -> None:
        self.created.append(body)

    def read_namespaced_pod(self, name: str, namespace: str, **_) -> V1Pod:
        return self.pods.pop(0) if len(self.pods) > 1 else self.pods[0]

    def read_namespaced_pod_log(self, name: str, namespace: str, **_) -> str:
        return self.log

    def delete_namespaced_pod(self, name: str, namespace: str, **_) -> None:
        self.deleted.append(name)

    def read_namespaced_config_map(self, name: str, namespace: str, **_) -> V1ConfigMap:
        if self.plugin_config is None:
            raise ApiException(status=404, reason="Not Found")
        return V1ConfigMap(metadata=V1ObjectMeta(name=name, namespace=namespace), data=self.plugin_config)

    def read_namespaced_persistent_volume_claim(self, name: str, namespace: str, **_) -> V1PersistentVolumeClaim:
        if not self.claim:
            raise ApiException(status=404, reason="Not Found")
        return V1PersistentVolumeClaim(metadata=V1ObjectMeta(name=name), status=V1PersistentVolumeClaimStatus(phase="Bound"))


def _run(core: FakeCore, topology=GPU1) -> dict[str, preflight.Check]:
    return {c.name: c for c in preflight.run(core, Cluster(gpu=True), topology, say=lambda _: None,
                                             timeout_s=5, poll_s=0)}


def test_a_ready_box_passes_and_the_probe_is_removed():
    core = FakeCore([_node("kvlab-worker", "4")],
                    [_pod("Pending", "ContainerCreating"), _pod("Running"), _pod("Succeeded")],
                    log="NVIDIA GeForce RTX 4090, 24564\n", claim=True)
    checks = _run(core)
    assert all(c.ok for c in checks.values()), checks
    assert list(checks) == ["GPU slots", "GPU sharing", "image", "GPU in a pod", "GPU memory", "model cache"]
    assert "24.0 GiB" in checks["GPU in a pod"].detail and "4.8 GiB per replica" in checks["GPU memory"].detail
    (pod,) = core.created
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert core.deleted == [preflight.PROBE_POD]


def test_probe_pod_validates_strictly():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(preflight.probe_pod(Cluster(gpu=True)), versions.KUBERNETES_VERSION, strict=True)


def test_no_gpu_node_or_too_few_slots_fail_before_any_pod():
    core = FakeCore([], [_pod("Succeeded")])
    assert "kvlab cluster create --gpu" in _run(core)["GPU nodes"].detail and not core.created
    core = FakeCore([_node("kvlab-worker", "1")], [_pod("Succeeded")])   # device plugin without time-slicing
    check = _run(core)["GPU slots"]
    assert not check.ok and "4 replicas need 4" in check.detail and "time-slices" in check.detail
    core = FakeCore([_node("kvlab-worker", None)], [_pod("Succeeded")])
    assert "device plugin" in _run(core)["GPU slots"].detail and not core.created


@pytest.mark.parametrize("pod, name, words", [
    (_pod("Pending", "ImagePullBackOff"), "image", "does not pull"),
    (_pod("Pending", "RunContainerError"), "GPU in a pod", "nvidia runtime"),
    (_pod("Pending", unschedulable="0/2 nodes are available: 2 Insufficient nvidia.com/gpu."), "GPU in a pod",
     "Insufficient nvidia.com/gpu"),
    (_pod("Pending", "ContainerCreating"), "GPU in a pod", "still Pending"),
])
def test_each_failure_is_named_and_the_probe_removed(pod, name, words):
    core = FakeCore([_node("kvlab-worker", "4")], [pod])
    checks = _run(core)
    assert not checks[name].ok and words in checks[name].detail
    assert "model cache" not in checks and core.deleted == [preflight.PROBE_POD]


def test_too_small_a_gpu_fails_and_a_missing_cache_is_only_a_note():
    core = FakeCore([_node("kvlab-worker", "4")], [_pod("Succeeded")], log="Tesla T4, 15360\n")
    checks = _run(core)
    assert not checks["GPU memory"].ok and "sized for 22 GiB" in checks["GPU memory"].detail
    gpu2 = load_topology(builtin("gpu-2"))
    core = FakeCore([_node("kvlab-worker", "4")], [_pod("Succeeded")], log="NVIDIA L4, 23034\nNVIDIA L4, 23034\n",
                    plugin_config=_plugin_config(gpu2))
    checks = _run(core, gpu2)
    assert checks["GPU memory"].ok
    assert not checks["model cache"].ok and not checks["model cache"].fatal


def test_deploy_stops_at_a_failed_preflight_before_applying(monkeypatch):
    """`kvlab cluster deploy baseline --gpu` runs the preflight step first; its failure ends the
    plan with the reason, and nothing is applied or waited on."""
    import io

    import kubernetes.client

    from kvlab.errors import StackError
    from kvlab.stack.kind import cli
    from kvlab.stack.kind.runner import Runner

    core = FakeCore([_node("kvlab-worker", "1")], [_pod("Succeeded")])
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda api=None: core)
    steps = cli.build_plan(cli._parser().parse_args(["deploy", "baseline", "--gpu", "--topology", "gpu-1", "--no-build"]))
    runner = Runner(out=io.StringIO())
    runner._clients["kind-kvlab"] = object()
    applied = []
    monkeypatch.setattr(runner, "_apply", lambda step: applied.append(step))
    with pytest.raises(StackError, match="preflight failed"):
        runner.run(steps)
    out = runner.out.getvalue()
    assert "FAIL GPU slots" in out and "4 replicas need 4" in out and not applied


def test_a_redeploy_skips_the_probe_its_replicas_would_starve():
    """All 4 slots are held by the running replicas: a probe pod would stay Pending (unschedulable),
    so the preflight says the GPU path already works and creates no pod."""
    serving = V1Pod(metadata=V1ObjectMeta(name="kvlab-replicas-x", namespace="kvlab"),
                    status=V1PodStatus(phase="Running", pod_ip="10.244.1.5",
                                       conditions=[V1PodCondition(type="Ready", status="True")]))
    core = FakeCore([_node("kvlab-worker", "4")], [_pod("Pending", unschedulable="0/2 nodes are available: "
                                                         "2 Insufficient nvidia.com/gpu.")], claim=True)
    core.replicas = [serving, serving]
    checks = _run(core)
    assert all(c.ok for c in checks.values()), checks
    assert "2 vLLM replica pod(s) already serve" in checks["GPU in a pod"].detail
    assert not core.created and "GPU memory" not in checks
    core.replicas = []       # a first deploy probes (here: starved by something else, and said so)
    assert "Insufficient nvidia.com/gpu" in _run(core)["GPU in a pod"].detail and core.created
