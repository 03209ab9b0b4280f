"""One renderer for kvlab's children (kvlab.stack.launch): a simulator or gateway setting reaches the
local stack, the notebooks' gateways and the kind manifests alike; the stack.json seam is typed."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvlab.contract import Endpoint
from kvlab.process import ProcessRecord
from kvlab.stack.base import StackInfo, read_info
from kvlab.stack.kind.manifests import gateway, replica_deployment
from kvlab.stack.kind.objects import Cluster
from kvlab.stack.launch import child_env, engine_argv, otel_env, sim_args
from kvlab.topology import GatewaySettings, SimSettings, Topology


def _flags(argv: list[str], names: list[str]) -> dict[str, str]:
    return {n: argv[argv.index(n) + 1] for n in names if n in argv}


def _topology() -> Topology:
    sim = SimSettings(profile="cpu-tiny", time_scale=0.5, block_size=32, num_blocks=77, max_num_seqs=9, seed=3)
    return msgspec.convert({"name": "t", "pools": [{"name": "replicas", "replicas": 2}], "sim": msgspec.to_builtins(sim),
                            "gateway": msgspec.to_builtins(GatewaySettings(policy="kv-aware", scrape_interval_ms=333))},
                           Topology)


def test_local_and_kind_engines_get_the_same_simulator_flags():
    t = _topology()
    local = engine_argv(t, t.pools[0], "sim", Path("/r.json"), Path("/logs"))
    pod = replica_deployment(t, t.pools[0], Cluster())["spec"]["template"]["spec"]["containers"][0]["args"]
    names = [a for a in sim_args(t.sim) if a.startswith("--")]
    assert _flags(local, names) == _flags(pod, names) == {
        "--profile": "cpu-tiny", "--time-scale": "0.5", "--block-size": "32", "--max-num-seqs": "9",
        "--max-num-batched-tokens": "2048", "--max-model-len": "8192", "--seed": "3", "--num-blocks": "77"}


def test_kind_gateway_and_pods_use_the_shared_gateway_flags_and_otel_env():
    t = _topology()
    manifests = gateway(t, Cluster())
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert _flags(container["args"], ["--policy", "--scrape-interval-ms"]) == {"--policy": "kv-aware",
                                                                             "--scrape-interval-ms": "333"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    for key, value in otel_env("kvlab-gateway", env["OTEL_EXPORTER_OTLP_ENDPOINT"]).items():
        assert env[key] == value


def test_child_env_drops_the_shells_exporter_and_exports_to_the_stack_or_nowhere():
    base = {"PATH": "/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://users-own:4318", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    on = child_env("kvlab-gateway", "http://stack:4318", 0.25, base=base)
    assert on["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://stack:4318" and on["OTEL_BSP_SCHEDULE_DELAY"] == "50"
    assert on["OTEL_TRACES_SAMPLER_ARG"] == "0.25" and on["PATH"] == "/bin"
    off = child_env("kvlab-gateway", None, base=base)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in off and off["OTEL_TRACES_EXPORTER"] == "none"


def test_stack_info_round_trips_through_stack_json(tmp_path):
    info = StackInfo(id="x", run_dir=str(tmp_path), target="kind-cpu", deployed="quickstart",
                     gateway="http://127.0.0.1:30081", baseline="http://127.0.0.1:30080", context="kind-kvlab")
    info.write()
    assert read_info(tmp_path) == info and info.topology_name == "quickstart"
    local = StackInfo(id="y", run_dir=str(tmp_path), topology=Topology(name="small"),
                      replicas=[Endpoint(name="sim-0", url="http://127.0.0.1:8001", kv_events="tcp://127.0.0.1:5557")],
                      supervisor=ProcessRecord(name="supervisor", pid=7, argv=["python", "-m", "x"]),
                      processes=[ProcessRecord(name="gateway", pid=8, argv=["kvlab", "gateway"], log="g.log")])
    local.write()
    back = read_info(tmp_path)
    assert back == local and back is not None and back.replicas[0].kv_events == "tcp://127.0.0.1:5557"
    (tmp_path / "stack.json").write_text("{not json")
    assert read_info(tmp_path) is None
    (tmp_path / "stack.json").write_text('{"id": "z", "run_dir": "r", "replicas": [{"name": 3}]}')
    assert read_info(tmp_path) is None           # typed all the way down: a bad replica is unreadable


def test_a_stack_json_from_before_the_typed_parts_still_reads(tmp_path):
    """Files written before replicas, processes and the supervisor were typed: a cluster's topology
    was `{"name": ...}`, the supervisor had neither name nor log."""
    (tmp_path / "stack.json").write_text(json.dumps({
        "id": "old", "run_dir": str(tmp_path), "status": "running", "target": "kind-cpu",
        "topology": {"name": "quickstart"}, "gateway": "http://127.0.0.1:30081",
        "replicas": [{"name": "sim-0", "url": "http://127.0.0.1:8001", "kv_events": None}],
        "supervisor": {"pid": 42, "argv": ["python", "-m", "kvlab.stack.supervisor"]},
        "processes": [{"name": "gateway", "pid": 43, "argv": ["kvlab", "gateway"], "log": "/x/gateway.log"}]}))
    info = read_info(tmp_path)
    assert info is not None and info.topology is None and info.topology_name == "quickstart"
    assert info.supervisor == ProcessRecord(name="supervisor", pid=42, argv=["python", "-m", "kvlab.stack.supervisor"])
    assert info.replicas == [Endpoint(name="sim-0", url="http://127.0.0.1:8001")]
    assert info.processes[0].log == "/x/gateway.log"
    # a local topology with a setting this version no longer has: the processes still read
    (tmp_path / "stack.json").write_text(json.dumps({
        "id": "older", "run_dir": str(tmp_path), "topology": {"name": "small", "retired_setting": 1},
        "processes": [{"name": "gateway", "pid": 43, "argv": ["kvlab", "gateway"], "log": ""}]}))
    info = read_info(tmp_path)
    assert info is not None and info.topology is None and info.topology_name == "small"
    assert [p.pid for p in info.processes] == [43]


def test_free_port_stays_below_the_ports_outgoing_connections_get():
    """A port in the OS's ephemeral range may become an outgoing connection's local end before the
    child binds it (a simulator once failed to start so, beside three busy test workers)."""
    from kvlab.lifecycle import _ephemeral_start, free_port

    ports = [free_port() for _ in range(32)]
    assert len(set(ports)) == 32 and all(1024 <= p < _ephemeral_start() for p in ports)


def test_free_port_never_hands_out_a_port_twice_even_when_the_os_offers_it_again(monkeypatch, tmp_path):
    """The OS may offer a just-closed port again; a stack asking for 16 ports before its children
    bind them must still get 16 different ones (a wide-EP stack once got 43895 twice)."""
    import socket

    from kvlab import lifecycle

    offers = iter([41000, 41000, 41001, 41000, 41001, 41002])

    class Fake:
        def __init__(self, *a: object) -> None:
            self.port = next(offers)

        def __enter__(self) -> Fake:
            return self

        def __exit__(self, *a: object) -> None:
            pass

        def bind(self, addr: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(lifecycle, "_HANDED_OUT", type(lifecycle._HANDED_OUT)(maxlen=16))
    monkeypatch.setattr(lifecycle, "_CLAIMS", tmp_path)
    monkeypatch.setattr(socket, "socket", Fake)
    assert [lifecycle.free_port() for _ in range(3)] == [41000, 41001, 41002]


def test_the_local_stack_gives_vllm_engines_their_ports_before_vllms_own_args(tmp_path, monkeypatch):
    """`--ports` after the `--` reached vLLM's api_server, which exited (kvlab lab --engine vllm)."""
    from kvlab.process import Child
    from kvlab.stack.local import LocalStack
    from kvlab.topology import load_topology, resolve_topology

    started: list[list[str]] = []

    def start(cls, name, argv, log, env=None):
        started.append(argv)
        raise RuntimeError("captured")

    monkeypatch.setattr(Child, "start", classmethod(start))
    stack = LocalStack(load_topology(resolve_topology("vllm")), tmp_path)
    try:
        stack.start_engines()
    except RuntimeError:
        pass
    [argv] = started
    assert argv.index("--ports") < argv.index("--") and argv.index("--kv-events-ports") < argv.index("--")
    assert argv[argv.index("--") + 1:] == ["--max-num-batched-tokens", "512"]


def test_free_port_skips_a_port_another_kvlab_process_handed_out_lately(monkeypatch, tmp_path):
    """Two processes drawing at once (xdist workers starting stacks) could both find a port free
    before either child binds it: a P/D simulator's KV-event bind once failed with EADDRINUSE so."""
    import os
    import socket

    from kvlab import lifecycle

    taken = 41000
    (tmp_path / str(taken)).touch()         # another process's claim: the file it left, just now
    offers = iter([taken, taken + 1])

    class Fake:
        def __init__(self, *a: object) -> None:
            self.port = next(offers)

        def __enter__(self) -> Fake:
            return self

        def __exit__(self, *a: object) -> None:
            pass

        def bind(self, addr: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(lifecycle, "_HANDED_OUT", type(lifecycle._HANDED_OUT)(maxlen=16))
    monkeypatch.setattr(lifecycle, "_CLAIMS", tmp_path)
    monkeypatch.setattr(socket, "socket", Fake)
    assert lifecycle.free_port() == taken + 1
    # a claim older than CLAIM_S is stale: the port is free to hand out again
    monkeypatch.setattr(lifecycle, "_HANDED_OUT", type(lifecycle._HANDED_OUT)(maxlen=16))
    old = lifecycle.time.time() - lifecycle.CLAIM_S - 1
    os.utime(tmp_path / str(taken), (old, old))
    offers = iter([taken])
    assert lifecycle.free_port() == taken
