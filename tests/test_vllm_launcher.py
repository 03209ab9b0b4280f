"""`kvlab engine vllm` without vLLM: the argv and environment it would start replicas with,
CPU pinning, OTLP settings, and decoding the KV-event encoding vLLM 0.32 actually sends."""

from __future__ import annotations

import json
import os
import tempfile

import msgspec
import pytest

from kvlab.engine import vllm as launcher
from kvlab.errors import ConfigError
from kvlab.kvcache.events import AllBlocksCleared, BlockStored, decode_batch


def _args(*argv: str):
    a = launcher.parser().parse_args(list(argv))
    a.extra = []
    return a


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_cpu_sets_split_disjoint_and_round_robin():
    assert launcher.cpu_sets("auto", 2, [0, 1]) == ["0", "1"]
    assert launcher.cpu_sets("auto", 1, [0, 1]) == ["0,1"]
    assert launcher.cpu_sets("auto", 2, [0, 1, 2, 3, 4]) == ["0,1,2", "3,4"]
    assert launcher.cpu_sets("auto", 3, [0, 1]) == ["0", "1", "0"]
    assert launcher.cpu_sets("0-1|2-3", 2) == ["0-1", "2-3"]
    assert launcher.cpu_sets("nobind", 2) == ["nobind", "nobind"]
    with pytest.raises(ConfigError):
        launcher.cpu_sets("0|1", 3)


def test_otlp_settings_follow_otel_env():
    assert launcher.otlp_settings({}) is None
    assert launcher.otlp_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318/"}) == \
        ("http://h:4318/v1/traces", "http/protobuf")
    assert launcher.otlp_settings({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:1/x"}) == \
        ("http://h:1/x", "http/protobuf")
    assert launcher.otlp_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317",
                                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == ("http://h:4317", "grpc")
    assert launcher.otlp_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318",
                                   "OTEL_TRACES_EXPORTER": "none"}) is None


def test_kv_events_stay_local_on_loopback_and_bind_the_wildcard_in_a_pod():
    assert launcher.kv_endpoints("10.1.2.3", 5557) == ("tcp://*:5557", "tcp://10.1.2.3:5557", None)
    for host in ("127.0.0.1", "localhost", "::1"):
        pub, sub, replay = launcher.kv_endpoints(host, 5557)
        assert pub == sub and pub.startswith("ipc://") and pub.endswith("/kv-5557.sock")
        assert replay == pub.replace(".sock", "-replay.sock")


def test_replica_argv_and_env(tmp_path):
    a = _args("--replicas", "2", "--ports", "8101,8102", "--kv-events-ports", "5601", "--name", "v",
              "--model", "m", "--kv-cache-gib", "1.5", "--max-model-len", "2048", "--cpus", "0|1")
    a.extra = ["--max-logprobs", "3"]
    specs = launcher.build_specs(a, tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert [s.name for s in specs] == ["v-0", "v-1"]
    s0, s1 = specs
    assert s0.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in s0.argv
    assert _flag(s0.argv, "--port") == "8101" and _flag(s1.argv, "--port") == "8102"
    assert _flag(s0.argv, "--served-model-name") == "m"
    assert _flag(s0.argv, "--block-size") == "128"
    assert _flag(s0.argv, "--max-model-len") == "2048"
    kv = json.loads(_flag(s0.argv, "--kv-events-config"))
    ipc = f"ipc://{tempfile.gettempdir()}/kvlab-{os.getuid()}/kv-5601.sock"   # loopback: no network socket
    replay = ipc.replace(".sock", "-replay.sock")
    assert kv == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ipc, "topic": "kv-events",
                  "replay_endpoint": replay}
    assert s0.kv_events == ipc and s0.kv_replay == replay
    assert s0.kv_port == 5601 and s1.kv_port not in (None, 5601)        # missing ports: free ones
    assert _flag(s0.argv, "--otlp-traces-endpoint") == "http://127.0.0.1:9/v1/traces"
    assert _flag(s0.argv, "--collect-detailed-traces") == "all"
    assert s0.argv[-2:] == ["--max-logprobs", "3"]                       # pass-through after `--`
    assert s0.env["VLLM_CPU_KVCACHE_SPACE"] == "2"                       # whole GiB, rounded up
    assert s0.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert (s0.env["VLLM_CPU_OMP_THREADS_BIND"], s1.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert s0.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert "kvlab.replica=v-0" in s0.env["OTEL_RESOURCE_ATTRIBUTES"]


def test_no_tracing_no_events_and_compile(tmp_path):
    a = _args("--no-kv-events", "--compile")
    (spec,) = launcher.build_specs(a, tmp_path, {})
    assert "--kv-events-config" not in spec.argv and spec.kv_port is None
    assert "--otlp-traces-endpoint" not in spec.argv
    assert "--enforce-eager" not in spec.argv


@pytest.mark.parametrize("argv", [["--role", "prefill"], ["--data-parallel-size", "2"], ["--replicas", "0"],
                                  ["--ports", "1,2", "--replicas", "1"], ["--kv-cache-gib", "0"]])
def test_bad_flags_are_config_errors(tmp_path, argv):
    with pytest.raises(ConfigError):
        launcher.build_specs(_args(*argv), tmp_path, {})


def test_cli_reports_bad_flags_without_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda name: object())
    assert launcher.main(["--model-dir", str(tmp_path)]) == 2               # no config.json there
    assert "config.json" in capsys.readouterr().err


def test_decodes_vllm_032_wire_form():
    """vLLM 0.32 sends the batch as an array and each event as a map tagged by "type"."""
    class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    events = [{"type": "AllBlocksCleared"},
              {"type": "BlockStored", "block_hashes": [2**63 + 5, 7], "parent_block_hash": None,
               "token_ids": list(range(256)), "block_size": 128, "lora_id": None, "medium": "CPU",
               "lora_name": None, "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
               "locality": None, "ownership": None, "session_id": None}]
    payload = msgspec.msgpack.encode(Batch(1.5, events))
    assert 0x90 <= payload[0] <= 0x9F               # an array, as on the wire
    batch = decode_batch(payload)
    assert isinstance(batch.events[0], AllBlocksCleared)
    stored = batch.events[1]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [2**63 + 5, 7] and stored.token_ids == list(range(256))
    assert stored.block_size == 128 and batch.ts == 1.5
