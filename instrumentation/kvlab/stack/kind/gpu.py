"""The GPU-specific parts of the kind manifests: vLLM's memory slice and KV cap, the persistent
model cache, and the device plugin's time-slicing config (several replicas on one GPU).

The lab's lever on GPU is the same as on CPU: a KV cache too small for every prompt group, so a
cache-blind router keeps evicting. vLLM would otherwise take ~90 % of GPU memory for its cache, and
every group would fit everywhere; `--num-gpu-blocks-override` caps it at the topology's block count.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvlab.topology import Topology

Manifest = dict[str, Any]

MODEL_CACHE_CLAIM = "kvlab-model-cache"   # kept across redeploys: deploy applies it, never deletes it
MODEL_CACHE_SIZE = "40Gi"
DEVICE_PLUGIN_CONFIG = "nvidia-device-plugin-config"
DEVICE_PLUGIN_CONFIG_PATH = "/etc/nvidia-device-plugin/config.yaml"


def vllm_args(topology: Topology) -> list[str]:
    """Block size, memory slice and KV cap every GPU replica runs with."""
    g = topology.gpu
    args = ["--block-size", str(g.block_size), "--gpu-memory-utilization", str(g.memory_utilization)]
    if g.num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(g.num_blocks)]
    return args


DP_RPC_PORT = 13345


def data_parallel_args(data_parallel_size: int, rank: int) -> list[str]:
    """A data-parallel replica on GPU is one `vllm serve` per rank in the pod (vLLM's external
    load-balancing DP mode, `--data-parallel-rank`), each with its own API port, API_PORT + rank —
    the port per rank the gateway's Kubernetes discovery expects. vLLM offsets each rank's KV-event
    endpoint by its rank itself (vllm.distributed.kv_events offset_endpoint_port), so every rank is
    given the same `tcp://*:5557` and publishes on 5557 + rank. Rank 0 hosts the DP coordination
    (`--data-parallel-address` is the pod itself, the ranks share its network namespace)."""
    if data_parallel_size == 1:
        return []
    return ["--data-parallel-size", str(data_parallel_size), "--data-parallel-rank", str(rank),
            "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(DP_RPC_PORT)]


def model_cache_claim(namespace: str) -> Manifest:
    """The Hugging Face / vLLM cache every vLLM pod mounts at /cache, so a restart or redeploy does
    not download the model again. kind's default StorageClass (local-path) keeps it on the GPU
    node's disk; ReadWriteOnce is enough because every GPU replica runs on that one node."""
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": MODEL_CACHE_CLAIM, "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "kvlab", "app.kubernetes.io/component": "model-cache"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": MODEL_CACHE_SIZE}}},
    }


def model_cache_volume() -> dict[str, Any]:
    return {"name": "cache", "persistentVolumeClaim": {"claimName": MODEL_CACHE_CLAIM}}


def time_slicing(replicas_per_gpu: int) -> dict[str, Any]:
    """NVIDIA device plugin config: each GPU is advertised as `replicas_per_gpu` `nvidia.com/gpu`
    slots (time-slicing; no memory isolation, hence each replica's --gpu-memory-utilization)."""
    return {"version": "v1", "flags": {"migStrategy": "none"},
            "sharing": {"timeSlicing": {"renameByDefault": False, "failRequestsGreaterThanOne": True,
                                        "resources": [{"name": "nvidia.com/gpu", "replicas": replicas_per_gpu}]}}}


def device_plugin_config(namespace: str, labels: dict[str, str], replicas_per_gpu: int) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": DEVICE_PLUGIN_CONFIG, "namespace": namespace, "labels": labels},
            "data": {"config.yaml": yaml.safe_dump(time_slicing(replicas_per_gpu), sort_keys=False)}}
