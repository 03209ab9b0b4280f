"""`kvlab lab --engine vllm` without vLLM: it picks the vllm topology and the workload that fits it,
and the KV-block cap of the topology reaches every vLLM server's argv."""

from __future__ import annotations

from kvlab import lab
from kvlab.engine import vllm as launcher
from kvlab.stack.local import KVLAB, engine_argv
from kvlab.topology import Topology, load_topology, resolve_topology


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_engine_vllm_picks_the_vllm_topology_and_its_workload():
    topology = lab._topology(lab.parser().parse_args(["--engine", "vllm", "--quick"]))
    assert (topology.name, topology.engine, topology.total_replicas) == ("vllm", "vllm", 2)
    assert lab.workload_params(topology, "shared-prefix", {}) == {"groups": 6}
    assert lab.workload_params(topology, "shared-prefix", {"groups": 3}) == {"groups": 3}
    assert lab.workload_params(topology, "multi-turn", {}) == {}
    default = lab._topology(lab.parser().parse_args([]))
    assert (default.name, default.engine) == ("quickstart", "sim")
    assert lab.workload_params(default, "shared-prefix", {}) == {}
    # an explicit topology keeps its own shape under --engine vllm
    explicit = lab._topology(lab.parser().parse_args(["--engine", "vllm", "--topology", "quickstart"]))
    assert (explicit.name, explicit.engine) == ("quickstart", "vllm")


def test_topology_block_cap_reaches_the_vllm_servers(tmp_path):
    topology = load_topology(resolve_topology("vllm"))
    assert topology.vllm.num_blocks == 64
    argv = engine_argv(topology, topology.pools[0], "vllm", tmp_path / "ready.json", tmp_path)
    assert argv[:len(KVLAB) + 2] == [*KVLAB, "engine", "vllm"]
    assert _flag(argv, "--num-blocks") == "64" and _flag(argv, "--block-size") == "128"
    # what the launcher makes of that argv: every vLLM server gets the cap, and a 512-token step
    # budget so a cache hit waits for at most a quarter of a cold prefill (docs/vllm.md)
    flags = argv[len(KVLAB) + 2:]
    a = launcher.parser().parse_args(flags[:flags.index("--")])
    a.extra = flags[flags.index("--") + 1:]
    specs = launcher.build_specs(a, tmp_path, {})
    assert len(specs) == 2
    for spec in specs:
        assert _flag(spec.argv, "--num-gpu-blocks-override") == "64"
        assert _flag(spec.argv, "--max-model-len") == "4096"
        assert _flag(spec.argv, "--max-num-batched-tokens") == "512"
    assert topology.sim.max_num_batched_tokens == 512      # `--engine sim` runs the same shape


def test_no_cap_by_default(tmp_path):
    topology = Topology(engine="vllm")
    argv = engine_argv(topology, topology.pools[0], "vllm", tmp_path / "ready.json", tmp_path)
    assert "--num-blocks" not in argv
