"""gpu-2: 4 vLLM replicas land 2 per GPU, by slot count (docs/kind.md, "Where the replicas land").

The device plugin advertises each GPU as `replicas` time-sliced slots, each a device ID of its
own; the kubelet gives a device ID to one pod at a time (Kubernetes device plugins: allocated
devices are exclusive to a container; extended resources are never overcommitted). So whatever
the scheduler and the kubelet pick, the replicas per GPU are bounded by the slots per GPU. These
tests take the slots from the rendered device plugin ConfigMap and the requests from the rendered
Deployment, and try every way the kubelet could hand out the slots. The preflight refuses a
cluster whose plugin offers more slots per GPU than the topology was sized for.
"""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import pytest
import yaml

from conftest import IN_CI

if not IN_CI:
    pytest.importorskip("kubernetes")
    pytest.importorskip("kubernetes_validate")

import kubernetes_validate
from kubernetes.client import V1ConfigMap, V1ObjectMeta
from kubernetes.client.exceptions import ApiException

from kvlab.stack.kind import gpu, preflight, versions
from kvlab.stack.kind.manifests import render
from kvlab.stack.kind.objects import Cluster
from kvlab.topology import Topology, builtin, load_topology

GPU1, GPU2 = load_topology(builtin("gpu-1")), load_topology(builtin("gpu-2"))


def _rendered(topology: Topology) -> dict[str, list[dict]]:
    return render(topology, Cluster(gpu=True))


def _plugin_slots(topology: Topology) -> int:
    """Slots per GPU in the device plugin config rendered for `topology` (1 without time-slicing)."""
    configs = [x for x in _rendered(topology)["gpu"] if x["kind"] == "ConfigMap"]
    if not configs:
        return 1
    (entry,) = yaml.safe_load(configs[0]["data"]["config.yaml"])["sharing"]["timeSlicing"]["resources"]
    return int(entry["replicas"])


def _gpu_pods(topology: Topology) -> int:
    """Pods asking for one nvidia.com/gpu each, from the rendered replica Deployments."""
    pods = 0
    for d in (x for x in _rendered(topology)["baseline"] if x["kind"] == "Deployment"):
        asks = [int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in d["spec"]["template"]["spec"]["containers"]]
        assert asks == [1] * len(asks)
        pods += d["spec"]["replicas"] * len(asks)
    return pods


def _per_gpu_outcomes(gpus: int, slots_per_gpu: int, pods: int) -> set[tuple[int, ...]]:
    """Every replicas-per-GPU outcome over all ways of giving each pod a distinct slot."""
    slots = [(g, k) for g in range(gpus) for k in range(slots_per_gpu)]
    return {tuple(sorted(Counter(g for g, _ in chosen).get(g, 0) for g in range(gpus)))
            for chosen in permutations(slots, pods)}


def test_gpu_2_replicas_land_two_per_gpu_whatever_slots_the_kubelet_picks():
    slots, pods = _plugin_slots(GPU2), _gpu_pods(GPU2)
    assert (GPU2.gpu.gpus, slots, pods) == (2, 2, 4)
    assert _per_gpu_outcomes(GPU2.gpu.gpus, slots, pods) == {(2, 2)}
    # a pool scaled down to 3 still never puts more than 2 on one GPU
    assert _per_gpu_outcomes(2, slots, 3) == {(1, 2)}
    # what the plugin config of another topology would allow: gpu-1's 4 slots per GPU on the 2-GPU box
    assert (3, 1) in {tuple(sorted(o, reverse=True)) for o in _per_gpu_outcomes(2, _plugin_slots(GPU1), pods)}


def test_every_gpu_topology_bounds_replicas_per_gpu_by_its_own_slots():
    for name in ("gpu-1", "gpu-2", "gpu-4"):
        t = load_topology(builtin(name))
        slots, pods = _plugin_slots(t), _gpu_pods(t)
        assert slots == t.gpu.replicas_per_gpu and pods <= t.gpu.gpus * slots, name
        assert max(max(o) for o in _per_gpu_outcomes(t.gpu.gpus, slots, pods)) == t.gpu.replicas_per_gpu, name
        assert t.gpu.replicas_per_gpu * t.gpu.memory_utilization <= 0.95, name   # the slices fit one GPU


def test_gpu_2_rendered_manifests_validate_strictly():
    for phase, manifests in _rendered(GPU2).items():
        for x in manifests:
            try:
                kubernetes_validate.validate(x, versions.KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{phase}: {x['kind']}/{x['metadata']['name']}: {exc.message}") from None


class PluginConfig:
    """read_namespaced_config_map as CoreV1Api answers it (404 when the plugin runs without a config)."""

    def __init__(self, topology: Topology | None) -> None:
        self.data = None
        if topology is not None:
            configs = [x for x in _rendered(topology)["gpu"] if x["kind"] == "ConfigMap"]
            self.data = configs[0]["data"] if configs else None

    def read_namespaced_config_map(self, name: str, namespace: str, **_) -> V1ConfigMap:
        assert (name, namespace) == (gpu.DEVICE_PLUGIN_CONFIG, preflight.PROBE_NAMESPACE)
        if self.data is None:
            raise ApiException(status=404, reason="Not Found")
        return V1ConfigMap(metadata=V1ObjectMeta(name=name, namespace=namespace), data=self.data)


def test_preflight_refuses_a_device_plugin_sliced_for_more_replicas_per_gpu():
    ok = preflight.sharing(PluginConfig(GPU2), GPU2)
    assert ok.ok and "at most 2 replica(s) per GPU" in ok.detail
    wrong = preflight.sharing(PluginConfig(GPU1), GPU2)          # cluster created with --topology gpu-1
    assert not wrong.ok and "offers 4 slots per GPU" in wrong.detail
    assert "kvlab cluster create --gpu --topology gpu-2" in wrong.detail
    # one slot per GPU (no time-slicing) is safe for the slices; too few slots is `GPU slots`' failure
    assert preflight.sharing(PluginConfig(None), GPU2).ok
    assert preflight.slots_per_gpu(PluginConfig(GPU1)) == 4
