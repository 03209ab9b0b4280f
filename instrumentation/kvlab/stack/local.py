"""The local stack: replicas, gateway and telemetry as supervised local processes.

Built from a Topology and used two ways: `kvlab up` runs it inside a detached supervisor process,
`kvlab lab` drives it directly (swapping the gateway's policy between phases). The stack is
engine-agnostic: it starts `kvlab engine <engine>` and learns the replicas from the ready JSON it
writes (contract 1), then hands that file to `kvlab gateway --endpoints-file`. Everything it
starts is recorded in runs/<id>/stack.json (contract 3) with pid, argv and log.
"""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec
import yaml

from kvlab.contract import Endpoint
from kvlab.errors import StackError
from kvlab.process import Child, ProcessRecord
from kvlab.stack.base import StackInfo
from kvlab.stack.launch import HOST, KVLAB, child_env, engine_argv, free_port, gateway_args
from kvlab.stack.prometheus import start_prometheus
from kvlab.stack.state import set_latest, write_json
from kvlab.telemetry.sink import TraceTarget, choose_trace_target
from kvlab.topology import Pool, Topology


def start_trace_backend(target: TraceTarget, log: Path, timeout_s: float = 30.0) -> Child | None:
    """Start the target's process (the sink or Jaeger) and wait until it listens; None when nothing
    must be started (an external endpoint). The caller stops it by pid."""
    if target.argv is None:
        return None
    target.write_config()
    child = Child.start("traces", target.argv, log)
    try:
        child.wait_http(target.ready_url or "", timeout_s)
    except StackError as exc:
        child.stop(5)
        raise StackError(f"trace backend: {exc}") from None
    return child


def _hostport(url: str) -> str:
    u = urlparse(url)
    return f"{u.hostname}:{u.port}"


def reset_replicas(replicas: list[Endpoint]) -> dict[str, str | None]:
    """POST /reset_prefix_cache on each replica reachable from here; a failure is a StackError."""
    for r in replicas:
        req = urllib.request.Request(f"{r.url}/reset_prefix_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                resp.read()
        except OSError as exc:
            raise StackError(f"reset_prefix_cache on {r.name} failed: {exc}") from None
    return {r.name: None for r in replicas}


class LocalStack:
    """Start, swap and stop the processes of one topology under `run_dir`."""

    def __init__(self, topology: Topology, run_dir: Path, ready_timeout_s: float | None = None,
                 policy: str | None = None, with_gateway: bool = True) -> None:
        self.topology = topology
        self.run_dir = Path(run_dir).absolute()
        self.logs = self.run_dir / "logs"
        self.ready_timeout_s = ready_timeout_s or (600.0 if topology.engine == "vllm" else 60.0)
        self.children: list[Child] = []
        self.replicas: list[Endpoint] = []
        self.gateway: Child | None = None
        self.gateway_port = free_port()
        self.policy: str | None = None
        self.otlp_endpoint: str | None = None
        self.traces_dir: Path | None = None
        self.prometheus: str | None = None
        self.scaler: Any = None           # kvlab.stack.scaler.Scaler when the topology autoscales
        self._span_export: Any = None     # this process's span processor (the scaler's spans)
        self._state_lock = threading.Lock()   # the scaler's thread writes stack.json too
        self._starting = False                # stack.json says "starting" until start() is done
        self.jaeger: str | None = None
        self.supervisor: ProcessRecord | None = None   # the supervisor process of `kvlab up`
        self.driver: ProcessRecord | None = None       # or the kvlab lab/compare driving it in-process
        self.start_policy = policy or topology.gateway.policy
        self.with_gateway = with_gateway             # False: gateways only through gateway_for()

    @property
    def gateway_url(self) -> str:
        return f"http://{HOST}:{self.gateway_port}"

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Telemetry, replicas, gateway and Prometheus; stack.json written; runs/latest updated."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        set_latest(self.run_dir)
        self._starting = True
        try:
            self.start_traces()
            self.write_state()    # each part recorded as soon as it runs: a killed driver leaves nothing unlisted
            self.start_engines()
            self.write_state()
            if self.with_gateway:
                self.start_gateway(self.start_policy)
            self.start_prometheus()
            if self.topology.gateway.autoscale is not None:
                self.start_scaler()
        except BaseException:
            self._starting = False
            self.stop()
            raise
        self._starting = False
        self.write_state()

    def stop(self) -> None:
        """Stop every process this stack started, newest first, and wait for each."""
        self.stop_scaler()
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        self.gateway = None
        self.write_state(status="stopped")

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- parts -----------------------------------------------------------------------------------
    def _env(self, service: str) -> dict[str, str]:
        return child_env(service, self.otlp_endpoint, self.topology.observability.sample_ratio)

    def start_traces(self) -> None:
        """OTLP endpoint for every process: the observability sink or Jaeger (if present), a URL, or off."""
        setting = self.topology.observability.traces
        if setting == "off":
            return
        target = choose_trace_target(setting, self.run_dir, HOST)
        self.otlp_endpoint = target.otlp_endpoint
        self.traces_dir = target.traces_dir
        if target.query_url:
            self.jaeger = target.query_url
        child = start_trace_backend(target, self.logs / f"{target.kind}.log")
        if child is not None:
            self.children.append(child)

    def start_engines(self) -> None:
        """One `kvlab engine` process per pool; waits for every ready JSON."""
        started = []
        single = len(self.topology.pools) == 1
        for pool in self.topology.pools:
            if pool.replicas == 0:
                continue
            name = self.topology.engine if single else pool.name
            ready = self.run_dir / f"ready-{pool.name}.json"
            ready.unlink(missing_ok=True)
            argv = engine_argv(self.topology, pool, name, ready, self.logs)
            n = pool.replicas * pool.data_parallel_size   # fixed ports: a restarted engine comes back on them
            ports = ["--ports", ",".join(str(free_port()) for _ in range(n)),
                     "--kv-events-ports", ",".join(str(free_port()) for _ in range(n))]
            at = argv.index("--") if "--" in argv else len(argv)   # before vLLM's own extra args
            argv[at:at] = ports
            child = Child.start(f"engine-{pool.name}", argv, self.logs / f"engine-{pool.name}.log",
                                self._env(f"kvlab-{self.topology.engine}"))
            self.children.append(child)
            started.append((child, ready))
        for child, ready in started:
            info = child.wait_ready_file(ready, self.ready_timeout_s)
            self.replicas.extend(msgspec.convert(info["replicas"], list[Endpoint]))
        write_json(self.run_dir / "endpoints.json", {"replicas": msgspec.to_builtins(self.replicas)})

    def start_gateway(self, policy: str) -> None:
        """`kvlab gateway` on the stack's fixed gateway port with `policy`; waits for /health."""
        if self.gateway is not None:
            raise StackError("a gateway is already running; stop_gateway() first")
        g = self.topology.gateway
        ready = self.run_dir / "ready-gateway.json"
        ready.unlink(missing_ok=True)
        config = str(self._autoscale_policy()) if g.autoscale is not None else g.config
        argv = [*KVLAB, *gateway_args(g, policy=policy, model=self.topology.model, host=HOST, port=self.gateway_port,
                                      config=config, tokenizer=self.topology.tokenizer),
                "--endpoints-file", str(self.run_dir / "endpoints.json"), "--ready-file", str(ready)]
        if g.autoscale is not None:   # watch the endpoints file the scaler rewrites
            argv += ["--discovery", "file"]
        child = Child.start("gateway", argv, self.logs / f"gateway-{policy}.log", self._env("kvlab-gateway"))
        self.children.append(child)
        self.gateway = child
        self.policy = policy
        child.wait_ready_file(ready, self.ready_timeout_s)
        child.wait_http(f"{self.gateway_url}/health", self.ready_timeout_s)
        self.write_state()

    def restart(self, child: Child, restarts: int) -> Child:
        """Start a dead child again with its argv and environment (engines on their fixed ports, the
        gateway on the stack's port); a `stack.restart` span records it."""
        from opentelemetry import trace

        from kvlab.telemetry import names

        if self._span_export is None:
            self._export_spans()
        code = child.proc.poll() if child.proc is not None else None
        with trace.get_tracer("kvlab.stack").start_as_current_span(names.SPAN_STACK_RESTART, attributes={
                names.STACK_CHILD: child.name, names.STACK_RESTARTS: restarts,
                names.STACK_EXIT_CODE: -1 if code is None else code}):
            new = Child.start(child.name, child.argv, child.log, child.env)
        self.children[self.children.index(child)] = new
        if child is self.gateway:
            self.gateway = new
        return new

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.children.remove(self.gateway)
            self.gateway = None
            self.policy = None
            self.write_state()

    def start_prometheus(self) -> None:
        """Prometheus scraping replicas and gateway, when the binary and the hook are there."""
        if self.topology.observability.prometheus == "off":
            return
        port = free_port()
        targets = {"replicas": [_hostport(r.url) for r in self.replicas],
                   "gateway": [f"{HOST}:{self.gateway_port}"]}
        try:
            child = start_prometheus(self.run_dir, targets, port)
        except StackError as exc:
            raise StackError(f"prometheus: {exc}") from None
        if child is not None:
            self.children.append(child)
            self.prometheus = f"http://{HOST}:{port}"
        self.write_state()

    # ---- autoscaling (docs/autoscaling.md) --------------------------------------------------------
    def _autoscale_policy(self) -> Path:
        """The gateway's policy file: `gateway.config` (if any) with the topology's `autoscale:`."""
        g = self.topology.gateway
        data: dict[str, Any] = {}
        if g.config:
            data = yaml.safe_load(Path(g.config).read_text()) or {}
        data["autoscale"] = msgspec.to_builtins(g.autoscale)
        path = self.run_dir / "gateway-policy.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def scale_pool(self) -> Pool:
        """The pool the scaler grows: the first one serving whole requests."""
        for pool in self.topology.pools:
            if pool.role == "both":
                return pool
        raise StackError("autoscaling needs a pool with role `both`")

    def start_scaler(self, interval_s: float = 1.0, drain_s: float = 2.0) -> None:
        """Act on the gateway's recommendation: one-replica engine processes of `scale_pool()`
        added/removed through the endpoints file; its `stack.scale` spans go to the run's traces."""
        from kvlab.stack.scaler import Scaler

        self._export_spans()
        one = msgspec.structs.replace(self.scale_pool(), replicas=1)
        self.scaler = Scaler(
            self.gateway_url, self.run_dir / "endpoints.json",
            lambda name, ready: engine_argv(self.topology, one, name, ready, self.logs),
            self.run_dir, prefix=f"{one.name}-scaled", env=self._env(f"kvlab-{self.topology.engine}"),
            interval_s=interval_s, drain_s=drain_s, ready_timeout_s=self.ready_timeout_s,
            on_change=self._scaled).start()

    def stop_scaler(self) -> None:
        if self.scaler is not None:
            self.scaler.stop()
            self.scaler = None
        if self._span_export is not None:   # flush the scaler's spans
            self._span_export.shutdown()
            self._span_export = None

    def _scaled(self, endpoints: list[Endpoint]) -> None:
        """After the scaler rewrote the endpoints file: replicas, Prometheus targets, stack.json."""
        self.replicas = list(endpoints)
        if self.prometheus:
            from kvlab.stack.prometheus import write_targets

            write_targets(self.run_dir, "replicas", [_hostport(r.url) for r in self.replicas])
        self.write_state()

    def _export_spans(self) -> None:
        """Spans made in this process (the scaler's) go to the run's OTLP endpoint."""
        if not self.otlp_endpoint:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from kvlab.telemetry.setup import configure_tracing

        self._span_export = BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{self.otlp_endpoint}/v1/traces"),
                                               schedule_delay_millis=1000)
        configure_tracing("kvlab-stack", extra=self._span_export)

    # ---- operations ----------------------------------------------------------------------------------
    def gateway_for(self, policy: str, fresh: bool = True, entry: str | None = None) -> str:
        """The stack's gateway routing with `policy`: restarted unless it already routes with it
        and `fresh` is False (an autoscaling run keeps the gateway its scaler follows)."""
        if fresh or self.gateway is None or self.policy != policy:
            self.stop_gateway()
            self.start_gateway(policy)
        return self.gateway_url

    def reset_caches(self) -> dict[str, str | None]:
        """POST /reset_prefix_cache on every replica (each then publishes AllBlocksCleared)."""
        return reset_replicas(self.replicas)

    def describe(self, status: str = "running") -> StackInfo:
        """The stack.json document (contract 3, plus `status`, `policy` and `model`)."""
        return StackInfo(
            id=self.run_dir.name, run_dir=str(self.run_dir), status=status,
            topology=self.topology, model=self.topology.model, policy=self.policy,
            gateway=self.gateway_url, replicas=list(self.replicas), otlp_endpoint=self.otlp_endpoint,
            traces_dir=str(self.traces_dir) if self.traces_dir else None, prometheus=self.prometheus,
            jaeger=self.jaeger, supervisor=self.supervisor, driver=self.driver,
            processes=[c.describe() for c in self.children]
                      + [s.child.describe() for s in (self.scaler.added if self.scaler else [])])

    def write_state(self, status: str | None = None) -> None:
        """stack.json; status defaults to "starting" during start(), "running" after."""
        if self.run_dir.exists():
            with self._state_lock:
                self.describe(status or ("starting" if self._starting else "running")).write()
