"""The GPU topologies as `kvlab cluster render --gpu` writes them: strict schema validation, and
the lab's GPU levers present and consistent — the KV cap and memory slice vLLM runs with, the
time-sliced device plugin that lets the replicas share GPUs, the persistent model cache and the
HF token Secret (referenced, never a value)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import IN_CI
from kvlab.errors import ConfigError, KvlabError
from kvlab.stack.kind import cli, gpu, versions
from kvlab.topology import GpuSettings, Pool, Topology, load_topology

if not IN_CI:
    pytest.importorskip("kubernetes_validate")
import kubernetes_validate

ROOT = Path(__file__).resolve().parents[1]
GPU_TOPOLOGIES = sorted((ROOT / "labs" / "topologies").glob("gpu-*.yaml"))


def _render(topology: Path, out: Path, *phases: str) -> dict[str, list[dict]]:
    subprocess.run([sys.executable, "-m", "kvlab.cli", "cluster", "render", *phases, "--gpu",
                    "--topology", str(topology), "--manifests-dir", str(out)], check=True, capture_output=True, text=True)
    return {p.stem: list(yaml.safe_load_all(p.read_text())) for p in sorted(out.glob("*.yaml"))}


def _arg(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} given {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module", params=[p.stem for p in GPU_TOPOLOGIES])
def rendered(request, tmp_path_factory):
    path = ROOT / "labs" / "topologies" / f"{request.param}.yaml"
    return load_topology(path), _render(path, tmp_path_factory.mktemp(request.param))


def test_gpu_topologies_for_one_two_and_four_gpus():
    assert sorted(load_topology(p).gpu.gpus for p in GPU_TOPOLOGIES) == [1, 2, 4]


@pytest.mark.processes
def test_rendered_files_validate_strictly(rendered):
    _, files = rendered
    assert sorted(files) == ["baseline", "gateway", "observability"]
    for phase, manifests in files.items():
        for x in manifests:
            try:
                kubernetes_validate.validate(x, versions.KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{phase}: {x['kind']}/{x['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.processes
def test_render_writes_what_deploy_applies(tmp_path):
    path = ROOT / "labs" / "topologies" / "gpu-1.yaml"
    files = _render(path, tmp_path, "baseline")
    args = cli._parser().parse_args(["deploy", "baseline", "--gpu", "--topology", str(path), "--no-build"])
    applied = [s.manifests for s in cli.build_plan(args) if s.action == "apply"]
    assert files == {"baseline": applied[0]}


@pytest.mark.processes
def test_kv_cap_memory_slice_cache_and_secret(rendered):
    topology, files = rendered
    deployments = [x for x in files["baseline"] if x["kind"] == "Deployment"]
    assert sum(d["spec"]["replicas"] for d in deployments) == topology.total_replicas
    claims = [x for x in files["baseline"] if x["kind"] == "PersistentVolumeClaim"]
    assert [c["metadata"]["name"] for c in claims] == [gpu.MODEL_CACHE_CLAIM]
    for d in deployments:
        spec = d["spec"]["template"]["spec"]
        (vllm,) = spec["containers"]
        args = vllm["args"]
        assert args[0] == topology.gpu.model
        assert int(_arg(args, "--num-gpu-blocks-override")) == topology.gpu.num_blocks
        assert int(_arg(args, "--block-size")) == topology.gpu.block_size
        share = float(_arg(args, "--gpu-memory-utilization"))
        assert share == topology.gpu.memory_utilization and share * topology.gpu.replicas_per_gpu <= 0.95
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
        # the model cache outlives the pod: /cache is the claim, not an emptyDir
        cache = next(v for v in spec["volumes"] if v["name"] == "cache")
        assert cache == {"name": "cache", "persistentVolumeClaim": {"claimName": gpu.MODEL_CACHE_CLAIM}}
        assert {"name": "cache", "mountPath": "/cache"} in vllm["volumeMounts"]
        assert {"name": "HF_HOME", "value": "/cache/huggingface"} in vllm["env"]
        token = next(e for e in vllm["env"] if e["name"] == "HF_TOKEN")
        assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token",
                                                                            "optional": True}}}


@pytest.mark.processes
def test_device_plugin_time_slices_as_the_topology_shares(rendered):
    topology, _ = rendered
    manifests = cli.build_plan(cli._parser().parse_args(
        ["create", "--gpu", "--topology", f"labs/topologies/{topology.name}.yaml"]))
    (step,) = [s for s in manifests if s.action == "apply"]
    daemonset = next(x for x in step.manifests if x["kind"] == "DaemonSet")
    env = {e["name"]: e["value"] for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}
    configs = [x for x in step.manifests if x["kind"] == "ConfigMap"]
    if topology.gpu.replicas_per_gpu == 1:
        assert not configs and "CONFIG_FILE" not in env
        return
    (config,) = configs
    sharing = yaml.safe_load(config["data"]["config.yaml"])["sharing"]["timeSlicing"]["resources"]
    assert sharing == [{"name": "nvidia.com/gpu", "replicas": topology.gpu.replicas_per_gpu}]
    assert env["CONFIG_FILE"] == gpu.DEVICE_PLUGIN_CONFIG_PATH
    # the slots it advertises are enough for every replica
    assert topology.gpu.gpus * topology.gpu.replicas_per_gpu >= topology.total_replicas


@pytest.mark.parametrize("settings, replicas", [
    ({"replicas_per_gpu": 4, "memory_utilization": 0.3}, 4),   # 120 % of a GPU
    ({"replicas_per_gpu": 2, "memory_utilization": 0.4}, 4),   # 4 replicas, 2 slots
    ({"gpus": 0}, 1),
])
def test_impossible_sharing_is_a_config_error(settings, replicas):
    with pytest.raises(ConfigError):
        Topology(pools=[Pool(replicas=replicas)], gpu=GpuSettings(**settings))


def test_render_needs_manifests_dir(capsys):
    assert cli.main(["render", "--gpu", "--topology", "gpu-1"]) == 1
    assert "--manifests-dir" in capsys.readouterr().err


def test_data_parallel_gpu_pods_serve_a_port_per_rank_as_discovery_expects():
    """One consistent DP model: a `vllm serve` per rank on API_PORT + rank (vLLM's external-LB DP),
    which is exactly the endpoints the gateway's Kubernetes discovery makes of the pod."""
    from kubernetes.client import V1ObjectMeta, V1Pod, V1PodStatus

    from kvlab.gateway.discovery.kubernetes import pod_endpoints
    from kvlab.stack.kind import objects as o
    from kvlab.stack.kind.manifests import render
    from kvlab.stack.kind.objects import API_PORT, KV_EVENTS_PORT

    topology = load_topology(ROOT / "labs" / "topologies" / "wide-ep.yaml")
    deployment = next(x for x in render(topology, o.Cluster(gpu=True))["baseline"] if x["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    containers = template["spec"]["containers"]
    dp = topology.pools[0].data_parallel_size
    assert len(containers) == dp
    served = []
    for rank, c in enumerate(containers):
        args = c["args"]
        assert int(_arg(args, "--data-parallel-rank")) == rank and int(_arg(args, "--data-parallel-size")) == dp
        http = next(p for p in c["ports"] if p["name"].startswith("http"))
        assert int(_arg(args, "--port")) == http["containerPort"] == API_PORT + rank
        assert c["readinessProbe"]["httpGet"]["port"] == http["name"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        kv = next(p for p in c["ports"] if p["name"].startswith("kv-events"))
        assert kv["containerPort"] == KV_EVENTS_PORT + rank    # vLLM offsets tcp://*:5557 by the rank
        served.append((f"http://10.0.0.7:{API_PORT + rank}", f"tcp://10.0.0.7:{KV_EVENTS_PORT + rank}"))
    pod = V1Pod(metadata=V1ObjectMeta(name="moe-0", labels=template["metadata"]["labels"],
                                      annotations=template["metadata"]["annotations"]),
                status=V1PodStatus(phase="Running", pod_ip="10.0.0.7"))
    assert [(e.url, e.kv_events) for e in pod_endpoints(pod, API_PORT, KV_EVENTS_PORT)] == served


def test_vllm_pods_publish_what_llm_d_precise_scorer_reads():
    """llm-d's precise prefix scorer (the `llm-d` phase on GPU) subscribes to every pod at
    KV_EVENTS_PORT + rank, keeps topics `kv@<pod-ip>@<model>` and recomputes vLLM's block hashes:
    the pods must publish there, hash with CBOR SHA-256 seeded like the scorer, in its block size."""
    from kvlab.stack.kind import llmd
    from kvlab.stack.kind import manifests as m
    from kvlab.stack.kind import objects as o
    from kvlab.stack.kind.plan import gateway_api_phases

    topology = load_topology(ROOT / "labs" / "topologies" / "gpu-1.yaml")
    cluster = o.Cluster(gpu=True)
    vllm = next(c for x in m.render(topology, cluster)["baseline"] if x["kind"] == "Deployment"
                for c in x["spec"]["template"]["spec"]["containers"])
    args, env = vllm["args"], {e["name"]: e for e in vllm["env"]}
    events = json.loads(_arg(args, "--kv-events-config"))
    assert events["topic"] == f"kv@$(POD_IP)@{topology.model}" and events["endpoint"].endswith(f":{o.KV_EVENTS_PORT}")
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert _arg(args, "--prefix-caching-hash-algo") == "sha256_cbor"
    plugins = yaml.safe_load(next(x for x in gateway_api_phases(topology, cluster)["llm-d"]
                                  if x["kind"] == "ConfigMap")["data"]["plugins.yaml"])["plugins"]
    scorer = next(p for p in plugins if p["type"] == "precise-prefix-cache-scorer")["parameters"]
    assert env["PYTHONHASHSEED"]["value"] == scorer["tokenProcessorConfig"]["hashSeed"] == llmd.KV_EVENTS_HASH_SEED
    assert scorer["tokenProcessorConfig"]["blockSize"] == int(_arg(args, "--block-size"))
    assert scorer["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == o.KV_EVENTS_PORT
    assert events["topic"].startswith(scorer["kvEventsConfig"]["topicFilter"])


SHIPPED = sorted((ROOT / "labs" / "topologies").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_gpu_render_of_every_shipped_topology_caps_the_kv_cache_or_refuses(path, capsys):
    """`--gpu` never renders an uncapped KV cache (uncapped, every prompt group fits on every replica
    and the lab shows no difference): a topology renders with its cap and GPU count, or is refused."""
    from kvlab.stack.kind import manifests as m
    from kvlab.stack.kind import objects as o

    topology = load_topology(path)
    args = cli._parser().parse_args(["render", "baseline", "--gpu", "--topology", str(path), "--manifests-dir", "unused"])
    if topology.gpu.num_blocks is None:
        with pytest.raises(KvlabError, match=re.escape("--topology gpu-1|gpu-2|gpu-4")):
            cli.topology_for(args)
        return
    assert cli.topology_for(args) == topology
    containers = [c for x in m.render(topology, o.Cluster(gpu=True))["baseline"] if x["kind"] == "Deployment"
                  for c in x["spec"]["template"]["spec"]["containers"]]
    assert containers
    for c in containers:
        assert int(_arg(c["args"], "--num-gpu-blocks-override")) == topology.gpu.num_blocks
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    slots = topology.gpu.gpus * topology.gpu.replicas_per_gpu
    assert len(containers) <= slots, f"{len(containers)} GPU containers, {slots} slots on {topology.gpu.gpus} GPUs"


@pytest.mark.parametrize("argv", [["render", "baseline", "--gpu", "--manifests-dir", "x"],
                                  ["deploy", "--gpu", "--dry-run"], ["create", "--gpu", "--dry-run"]])
def test_gpu_without_topology_refuses_where_nothing_is_touched(argv, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "host_gpus", lambda: pytest.fail("render/--dry-run must not probe the host"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "--topology gpu-1|gpu-2|gpu-4" in err
    assert not list(tmp_path.iterdir()), "nothing rendered"


@pytest.mark.parametrize("gpus, chosen", [(1, "gpu-1"), (2, "gpu-2"), (3, "gpu-2"), (4, "gpu-4"), (8, "gpu-4")])
def test_gpu_deploy_without_topology_picks_the_one_fitting_the_host(gpus, chosen, monkeypatch, capsys):
    monkeypatch.setattr(cli, "host_gpus", lambda: gpus)
    steps = cli.build_plan(cli._parser().parse_args(["deploy", "baseline", "--gpu", "--no-build"]))
    topology = load_topology(ROOT / "labs" / "topologies" / f"{chosen}.yaml")
    vllm = next(c for s in steps if s.action == "apply" for x in s.manifests if x["kind"] == "Deployment"
                for c in x["spec"]["template"]["spec"]["containers"])
    assert int(_arg(vllm["args"], "--num-gpu-blocks-override")) == topology.gpu.num_blocks
    assert f"using --topology {chosen}" in capsys.readouterr().err


def test_gpu_deploy_without_topology_and_without_gpus_says_what_to_run(monkeypatch, capsys):
    monkeypatch.setattr(cli, "host_gpus", lambda: 0)
    assert cli.main(["deploy", "--gpu", "--no-build"]) == 1
    assert "--topology gpu-1|gpu-2|gpu-4" in capsys.readouterr().err
