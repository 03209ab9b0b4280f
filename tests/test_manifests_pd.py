"""The kind path for prefill/decode disaggregation: vLLM pods of a P/D topology carry vLLM's
NixlConnector (kv_both), advertise their NIXL side channel on the pod IP, and only they do; the
gateway's pod states the split rule its policy resolves to; discovery reads the pools' roles."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from conftest import IN_CI
from kvlab.errors import ConfigError
from kvlab.stack.kind import versions
from kvlab.stack.kind.manifests import render
from kvlab.stack.kind.objects import NIXL_SIDE_CHANNEL_PORT, PD_ANNOTATION, Cluster
from kvlab.topology import GatewaySettings, Pool, Topology, VllmSettings, builtin, load_topology

if not IN_CI:  # in CI a missing validator fails at import instead of skipping
    pytest.importorskip("kubernetes_validate")
import kubernetes_validate

PD = load_topology(builtin("pd"))


def _deployments(topology: Topology, gpu: bool) -> dict[str, dict]:
    return {x["metadata"]["name"]: x for ms in render(topology, Cluster(gpu=gpu)).values() for x in ms
            if x["kind"] == "Deployment"}


def _replica_containers(topology: Topology, gpu: bool) -> dict[str, dict]:
    return {pool.name: _deployments(topology, gpu)[f"kvlab-{pool.name}"]["spec"]["template"]["spec"]["containers"][0]
            for pool in topology.pools}


def _kv_transfer_configs(args: list[str]) -> list[dict]:
    return [json.loads(args[i + 1]) for i, a in enumerate(args) if a == "--kv-transfer-config"]


def test_gpu_pd_pools_get_the_nixl_connector():
    for pool, c in _replica_containers(PD, gpu=True).items():
        assert c["command"] == ["vllm", "serve"]
        assert _kv_transfer_configs(c["args"]) == [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}], pool
        env = {e["name"]: e for e in c["env"]}
        # the decode pod handshakes with the prefill pod at the host its kv_transfer_params name
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(NIXL_SIDE_CHANNEL_PORT)
        assert {"name": "nixl", "containerPort": NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"} in c["ports"]
    for x in _deployments(PD, gpu=True).values():
        kubernetes_validate.validate(x, versions.KUBERNETES_VERSION, strict=True)


def test_a_both_pool_next_to_a_prefill_pool_takes_part_too():
    topo = Topology(pools=[Pool(name="prefill", role="prefill", replicas=1), Pool(name="mixed", role="both", replicas=2)])
    containers = _replica_containers(topo, gpu=True)
    assert all(_kv_transfer_configs(c["args"]) for c in containers.values())


def test_no_connector_without_pd_or_on_the_simulator():
    for c in _replica_containers(Topology(), gpu=True).values():         # a single `both` pool: unified only
        assert not _kv_transfer_configs(c["args"])
        assert not any(e["name"].startswith("VLLM_NIXL") for e in c["env"])
        assert all(not p["name"].startswith("nixl") for p in c["ports"])
    for c in _replica_containers(PD, gpu=False).values():           # the simulator speaks the protocol itself
        assert c["args"][:2] == ["engine", "sim"] and "--kv-transfer-config" not in c["args"]
        assert not any(e["name"].startswith("VLLM_NIXL") for e in c["env"])


def test_a_users_own_kv_transfer_config_wins():
    own = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}})
    topo = msgspec.structs.replace(PD, vllm=VllmSettings(extra_args=["--kv-transfer-config", own]))
    for c in _replica_containers(topo, gpu=True).values():
        assert _kv_transfer_configs(c["args"]) == [json.loads(own)]
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in {e["name"] for e in c["env"]}


def test_data_parallel_ranks_get_one_side_channel_port_each():
    topo = Topology(pools=[Pool(name="prefill", role="prefill", replicas=1),
                           Pool(name="decode", role="decode", replicas=1, data_parallel_size=2)])
    # one `vllm serve` per rank (container), each with its own side channel port
    containers = _deployments(topo, True)["kvlab-decode"]["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for c in containers for p in c["ports"]}
    assert ports["nixl"] == NIXL_SIDE_CHANNEL_PORT and ports["nixl-1"] == NIXL_SIDE_CHANNEL_PORT + 1


def _gateway_pd(topology: Topology) -> str | None:
    gw = _deployments(topology, gpu=False)["kvlab-gateway"]
    return gw["spec"]["template"]["metadata"]["annotations"].get(PD_ANNOTATION)


def test_gateway_states_the_split_rule_of_its_policy(tmp_path: Path):
    assert _gateway_pd(PD) == "split at 256 uncached tokens"
    assert _gateway_pd(Topology()) is None                                   # not a P/D topology
    unified = msgspec.structs.replace(PD, gateway=GatewaySettings(policy="kv-aware-unified"))
    assert _gateway_pd(unified) == "off"
    config = tmp_path / "gateway.yaml"
    config.write_text("pd:\n  threshold_tokens: 512\n")
    tuned = msgspec.structs.replace(PD, gateway=GatewaySettings(policy="kv-aware", config=str(config)))
    assert _gateway_pd(tuned) == "split at 512 uncached tokens"
    # the same file reaches the gateway pod, so the annotation and the running gateway agree
    maps = {x["metadata"]["name"]: x for ms in render(tuned, Cluster()).values() for x in ms if x["kind"] == "ConfigMap"}
    assert "threshold_tokens: 512" in maps["kvlab-gateway-config"]["data"]["gateway.yaml"]


def test_prefill_only_topology_is_refused():
    with pytest.raises(ConfigError, match="decode"):
        render(Topology(pools=[Pool(name="prefill", role="prefill", replicas=2)]), Cluster())


def test_discovery_reads_the_rendered_roles():
    kubernetes = pytest.importorskip("kubernetes") if not IN_CI else __import__("kubernetes")
    from kvlab.gateway.discovery.kubernetes import pod_endpoints

    client = kubernetes.client
    for pool in PD.pools:
        template = _deployments(PD, gpu=True)[f"kvlab-{pool.name}"]["spec"]["template"]["metadata"]
        pod = client.V1Pod(metadata=client.V1ObjectMeta(name=f"kvlab-{pool.name}-x", labels=template["labels"],
                                                        annotations=template["annotations"]),
                           status=client.V1PodStatus(pod_ip="10.244.1.7"))
        (endpoint,) = pod_endpoints(pod, 8000, 5557)
        assert endpoint.role == pool.role
