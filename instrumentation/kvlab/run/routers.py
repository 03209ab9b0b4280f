"""The routers `kvlab compare` and `kvlab lab --policies` put in front of the same replicas.

A router is named on the command line and is one of:

- a kvlab preset (`round-robin`, `prefix`, `kv-aware`, ...): the stack's own `kvlab gateway`;
- `vllm-router:<policy>`: vllm-router (`pip install 'kvlab[peers]'`) started here, fed the
  replicas' URLs and, for `kv_aware`, their KV-event endpoints;
- any router given as `--router 'NAME=COMMAND'`: a command template started here;
- on a kind cluster (`kvlab compare --cluster`, compare/cluster.py), one of its front doors.

Peers are command templates too (`VLLM_ROUTER` below), so there is one way to start a router. In a
template `{host}`, `{port}` (where the router must listen), `{metrics_port}` (a second free port, for
routers whose metrics port is fixed), `{model}` and `{block_size}` are filled once; a word holding
`{url}`, `{kv_events}` or `{replica}` is repeated once per replica with that replica's values. So
`--worker-urls {url}` passes every URL, and `--kv-event-source={url}={kv_events}` one flag per replica.
A router is ready when GET /health or /v1/models answers 200.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import msgspec
from rich.console import Console

from kvlab.compare.results import KV_PREFIX, metric_counters
from kvlab.contract import Endpoint
from kvlab.errors import ConfigError, StackError
from kvlab.gateway.config import PRESETS
from kvlab.lifecycle import free_port, http_ok
from kvlab.process import Child, own_record
from kvlab.run.phases import Phase
from kvlab.run.tcp_events import Relay
from kvlab.stack.base import Stack, StackInfo, stop_left_over
from kvlab.stack.launch import HOST
from kvlab.stack.local import LocalStack
from kvlab.stack.state import runs_dir
from kvlab.topology import Topology

VLLM_ROUTER = ("vllm-router --host {host} --port {port} --worker-urls {url} --policy %s "
               "--prometheus-port {metrics_port}")
VLLM_ROUTER_KV_EVENTS = (" --kv-event-source={url}={kv_events} --kv-event-model {model} "
                         "--kv-event-block-size {block_size}")
VLLM_ROUTER_POLICIES = ("round_robin", "random", "power_of_two", "consistent_hash", "cache_aware", "kv_aware")
PER_REPLICA = ("{url}", "{kv_events}", "{replica}")


class Router(msgspec.Struct, frozen=True):
    """One router to compare, by the name it was given: a kvlab preset (served by `kvlab gateway`),
    a peer started from `template`, or a cluster's front door `entry` routed by `policy`."""

    name: str
    template: str | None = None
    policy: str | None = None   # what routes it, when not its name (a cluster's kube-proxy, llm-d, gateway preset)
    entry: str | None = None    # a cluster's front door: baseline, gateway, gateway-api, llm-d

    @property
    def phase(self) -> Phase:
        """The phase `run_phases` benches it in."""
        return Phase(self.name, self.policy or self.name, entry=self.entry)

    @property
    def peer(self) -> bool:
        """Not routed by kvlab: a started peer, a cluster's kube-proxy or llm-d."""
        return self.phase.policy not in PRESETS


def vllm_router(policy: str) -> str:
    """vllm-router's command template for `policy` (kv_aware subscribes to every replica's KV events)."""
    return VLLM_ROUTER % policy + (VLLM_ROUTER_KV_EVENTS if policy == "kv_aware" else "")


def commands(given: list[str]) -> dict[str, str]:
    """`--router NAME=COMMAND` flags as {name: template}; a malformed one is a ConfigError."""
    out: dict[str, str] = {}
    for item in given:
        name, sep, template = item.partition("=")
        name, template = name.strip(), template.strip()
        if not sep or not name or not template:
            raise ConfigError(f"--router {item!r}: expected NAME=COMMAND, e.g. "
                              "'mine=my-router --port {port} --backends {url}'")
        if name in PRESETS or name.startswith("vllm-router:"):
            raise ConfigError(f"--router {name!r}: that name is taken by a built-in router; choose another")
        _check_template(name, template)
        out[name] = template
    return out


def _check_template(name: str, template: str) -> None:
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise ConfigError(f"router {name!r}: cannot split its command: {exc}") from None
    if "{port}" not in template:
        raise ConfigError(f"router {name!r}: its command must listen on {{port}} (kvlab picks a free one)")
    try:
        for word in words:
            word.format(host="", port=0, metrics_port=0, model="", block_size=0, url="", kv_events="", replica="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"router {name!r}: unknown placeholder {exc} in its command; known: {{host}} {{port}} "
                          "{metrics_port} {model} {block_size} {url} {kv_events} {replica}") from None


def unique(names: list[str]) -> list[str]:
    """`names` unchanged; a name given twice is a ConfigError (each router gets one row)."""
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"router {name!r} is named twice")
    return names


def resolve(names: list[str], custom: dict[str, str] | None = None) -> list[Router]:
    """The routers `names` name, in order; an unknown or repeated name is a ConfigError listing the choices."""
    custom = custom or {}
    out: list[Router] = []
    for name in unique(names):
        if name in PRESETS:
            out.append(Router(name))
        elif name.startswith("vllm-router:"):
            policy = name.removeprefix("vllm-router:")
            if policy not in VLLM_ROUTER_POLICIES:
                raise ConfigError(f"unknown vllm-router policy {policy!r}; choose one of: "
                                  + ", ".join(VLLM_ROUTER_POLICIES))
            out.append(Router(name, vllm_router(policy)))
        elif name in custom:
            out.append(Router(name, custom[name]))
        else:
            raise ConfigError(f"unknown router {name!r}: kvlab presets are {', '.join(PRESETS)}; peers are "
                              f"vllm-router:<{'|'.join(VLLM_ROUTER_POLICIES)}>; or define it with "
                              f"--router '{name}=COMMAND'")
    return out


def render(template: str, replicas: list[Endpoint], *, port: int, metrics_port: int, model: str,
           block_size: int) -> list[str]:
    """The argv of a router command template for `replicas` (module docstring)."""
    fixed = {"host": HOST, "port": port, "metrics_port": metrics_port, "model": model, "block_size": block_size}
    argv: list[str] = []
    for word in shlex.split(template):
        if any(p in word for p in PER_REPLICA):
            for r in replicas:
                if "{kv_events}" in word and not r.kv_events:
                    raise StackError(f"replica {r.name} publishes no KV events, which the router needs")
                argv.append(word.format(**fixed, url=r.url, kv_events=r.kv_events or "", replica=r.name))
        else:
            argv.append(word.format(**fixed))
    argv[0] = program(argv[0])
    return argv


def program(name: str) -> str:
    """`name` on PATH or beside this Python (a venv's console scripts); a StackError if neither."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        hint = " (install the peers extra: pip install 'kvlab[peers]')" if name == "vllm-router" else ""
        raise StackError(f"router command {name!r} not found{hint}")
    return found


def capacity(topology: Topology) -> tuple[int, int | None]:
    """(block size, blocks per replica) of the topology's engine; None blocks: sized by the engine."""
    s = topology.sim if topology.engine == "sim" else topology.vllm
    return s.block_size, s.num_blocks


class RoutedStack(Stack, Protocol):
    """What `kvlab compare` measures routers on: a local `RouterStack` or a kind cluster's `ClusterStack`."""

    def replica_names(self) -> list[str]:
        """The replicas behind every router (the oracle pools their caches)."""
        ...

    def replica_metrics(self) -> dict[str, list[str]]:
        """Each replica's Prometheus page(s) now, one per HTTP port; a replica that does not answer is left out."""
        ...

    def peer_counters(self) -> dict[str, float]:
        """The running peer's own KV-path counters (empty when there are none to read)."""
        ...


class RouterStack:
    """A local stack whose `gateway_for` also starts peers: the one way `kvlab compare` and
    `kvlab lab` switch routers. kvlab presets go to the stack's own gateway; a peer is started on
    a free port (the previous router stopped first, so one router at a time sees the replicas)."""

    def __init__(self, base: LocalStack, routers: list[Router]) -> None:
        self.base = base
        self.routers = {r.name: r for r in routers}
        self.block_size = capacity(base.topology)[0]
        self.ready_timeout_s = base.ready_timeout_s
        self.peer: Child | None = None
        self.peer_metrics: str | None = None   # the running peer's /metrics, when its template has one
        self.relay: Relay | None = None   # KV events over TCP for the running peer, when it needs them

    @property
    def otlp_endpoint(self) -> str | None:
        return self.base.otlp_endpoint

    def start(self) -> None:
        self.base.start()

    def stop(self) -> None:
        self.stop_gateway()
        self.base.stop()

    def reset_caches(self) -> dict[str, str | None]:
        return self.base.reset_caches()

    def describe(self) -> StackInfo:
        return self.base.describe()

    def replica_names(self) -> list[str]:
        return [r.name for r in self.base.replicas]

    def replica_metrics(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for r in self.base.replicas:
            try:
                with urllib.request.urlopen(f"{r.url}/metrics", timeout=5) as resp:
                    out[r.name] = [resp.read().decode()]
            except OSError:
                continue
        return out

    def peer_counters(self) -> dict[str, float]:
        """The running peer's own KV-path counters (vllm-router's `vllm_router_kv_*_total`); empty for
        a kvlab router, a peer without `{metrics_port}` or one whose metrics do not answer."""
        if self.peer is None or self.peer_metrics is None:
            return {}
        try:
            with urllib.request.urlopen(self.peer_metrics, timeout=5) as resp:
                return metric_counters(resp.read().decode(), KV_PREFIX)
        except (OSError, ValueError):
            return {}

    def stop_peer(self) -> None:
        self.peer_metrics = None
        if self.peer is not None:
            self.peer.stop()
            self.base.children.remove(self.peer)
            self.peer = None
            self.base.write_state()
        if self.relay is not None:
            self.relay.stop()
            self.relay = None

    def stop_gateway(self) -> None:
        """Stop whichever router runs (kvlab's gateway or a peer)."""
        self.stop_peer()
        self.base.stop_gateway()

    def gateway_for(self, policy: str, fresh: bool = True, entry: str | None = None) -> str:
        router = self.routers.get(policy) or Router(policy)
        if router.template is None:
            self.stop_peer()
            return self.base.gateway_for(policy, fresh=fresh, entry=entry)
        self.stop_gateway()
        return self._start_peer(router.name, router.template)

    def _start_peer(self, name: str, template: str) -> str:
        if any(r.role != "both" for r in self.base.replicas):
            raise StackError(f"router {name}: peers route whole requests; this topology splits prefill and decode")
        replicas = self.base.replicas
        local = [r.kv_events for r in replicas if (r.kv_events or "").startswith("ipc://")]
        if "{kv_events}" in template and local:   # vLLM's Unix sockets: relayed to loopback TCP
            self.relay = Relay([r.kv_events or "" for r in replicas])
            replicas = [msgspec.structs.replace(r, kv_events=e)
                        for r, e in zip(replicas, self.relay.endpoints, strict=True)]
        port, metrics_port = free_port(), free_port()
        argv = render(template, replicas, port=port, metrics_port=metrics_port,
                      model=self.base.topology.model, block_size=self.block_size)
        if "{metrics_port}" in template:
            self.peer_metrics = f"http://{HOST}:{metrics_port}/metrics"
        log = self.base.logs / f"router-{name.replace(':', '-')}.log"
        self.peer = Child.start(f"router-{name}", argv, log)
        self.base.children.append(self.peer)   # in stack.json, so `kvlab down` stops it too
        self.base.write_state()
        url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + self.ready_timeout_s
        while not (http_ok(f"{url}/health") or http_ok(f"{url}/v1/models")):
            if not self.peer.alive():
                raise self.peer.fail("exited before it was ready")
            if time.monotonic() > deadline:
                raise self.peer.fail(f"answered neither {url}/health nor /v1/models in {self.ready_timeout_s:.0f} s")
            time.sleep(0.1)
        self.base.write_state()
        return url


@contextmanager
def local_routers(console: Console, topology: Topology, run_dir: Path, routers: list[Router],
                  advice: list[str]) -> Iterator[RouterStack]:
    """The replicas of `topology` started (a line says so) behind `routers`, for `kvlab lab` and
    `kvlab compare`; a StackError gains the logs' place and doctor's `advice`; all stopped on exit."""
    started = time.monotonic()
    for latest in dict.fromkeys([runs_dir() / "latest", Path(run_dir).parent / "latest"]):
        if left := stop_left_over(latest):
            console.print(f"[yellow]![/yellow] stopped {left} process{'es' if left != 1 else ''} that a killed run "
                          f"left running ({latest.resolve().name})")
    with LocalStack(topology, run_dir, with_gateway=False) as base:
        base.driver = own_record("driver")   # a later run stops what this one leaves if it is killed
        stack = RouterStack(base, routers)
        with console.status("starting replicas and telemetry..."):
            stack.start()
        console.print(f"[green]✓[/green] replicas up: {', '.join(r.name for r in base.replicas)} "
                      f"({time.monotonic() - started:.0f} s); logs in {base.logs}")
        try:
            yield stack
        except StackError as exc:
            hints = "".join(f"\n  doctor: {a}" for a in advice)
            raise StackError(f"{exc}; {topology.engine} replica logs in {base.logs}{hints}") from None
        finally:
            stack.stop_gateway()
