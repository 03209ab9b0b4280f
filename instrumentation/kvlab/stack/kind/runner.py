"""Executes a plan: commands through subprocess, cluster steps through the `kubernetes` client."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from typing import Any

from kvlab.errors import StackError
from kvlab.stack.kind.plan import Step

FIELD_MANAGER = "kvlab"


def api_client(context: str | None) -> Any:
    """An ApiClient for a kube context (None: the current one)."""
    from kubernetes import config

    try:
        return config.new_client_from_config(context=context)  # type: ignore[no-untyped-call]  # kubernetes.config is untyped
    except Exception as exc:
        raise StackError(f"no usable kube context {context or '(current)'}: {exc}; "
                         "is the cluster created (`kvlab cluster create`)?") from None


class Runner:
    """Runs steps in order, printing each; the first failure stops the plan with a StackError."""

    def __init__(self, out: Any = sys.stdout) -> None:
        self.out = out
        self._clients: dict[str | None, Any] = {}

    def run(self, steps: list[Step]) -> None:
        for i, step in enumerate(steps, 1):
            print(f"[{i}/{len(steps)}] {step.describe()}", file=self.out, flush=True)
            getattr(self, f"_{step.action}")(step)

    def _client(self, context: str | None) -> Any:
        if context not in self._clients:
            self._clients[context] = api_client(context)
        return self._clients[context]

    def _run(self, step: Step) -> None:
        try:
            proc = subprocess.run(step.argv, check=False)
        except FileNotFoundError:
            raise StackError(f"{step.argv[0]!r} is not installed or not on PATH (needed to {step.what}); "
                             "see docs/kind.md, 'Prerequisites'") from None
        if proc.returncode != 0:
            raise StackError(f"{step.what} failed (exit {proc.returncode}): {' '.join(step.argv)}")

    def _note(self, step: Step) -> None:
        pass

    def _apply(self, step: Step) -> None:
        from kubernetes.dynamic import DynamicClient
        from kubernetes.dynamic.exceptions import DynamicApiError

        dyn = DynamicClient(self._client(step.context))  # type: ignore[no-untyped-call]  # kubernetes.dynamic is untyped
        for manifest in step.manifests:
            resource = dyn.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
            meta = manifest["metadata"]
            try:
                resource.server_side_apply(body=manifest, name=meta["name"], namespace=meta.get("namespace"),
                                           field_manager=FIELD_MANAGER, force_conflicts=True)
            except DynamicApiError as exc:
                why = exc.summary()  # type: ignore[no-untyped-call]  # kubernetes.dynamic is untyped
                raise StackError(f"apply {manifest['kind']}/{meta['name']} failed: {why}") from None
            print(f"    applied {manifest['kind'].lower()}/{meta['name']}", file=self.out, flush=True)

    def _rollout(self, step: Step) -> None:
        """Wait until the Deployment/DaemonSet is rolled out; meanwhile show what each of its pods
        is doing (image pull, weight download, loading: `startup.PodWatch`), live on a terminal,
        one line per change otherwise."""
        from kubernetes import client
        from rich.console import Console
        from rich.live import Live

        from kvlab.stack.kind.startup import PodWatch, table

        assert step.kind is not None and step.name is not None and step.namespace is not None
        kind, name, namespace = step.kind, step.name, step.namespace
        apps = client.AppsV1Api(self._client(step.context))
        read = (apps.read_namespaced_deployment_status if kind == "Deployment"
                else apps.read_namespaced_daemon_set_status)
        console = Console(file=self.out, width=160)
        watch: PodWatch | None = None
        deadline = time.monotonic() + step.timeout_s
        last, shown = "", dict[tuple[str, str], tuple[str, str]]()
        live_table = Live(console=console, auto_refresh=False, transient=True) if console.is_terminal else None
        with live_table or contextlib.nullcontext() as live:
            while True:
                obj = read(name, namespace)
                done, state = rollout_state(kind, obj)
                if state != last:
                    console.print(f"    {kind.lower()}/{name}: {state}", highlight=False)
                    last = state
                if done:
                    return
                if watch is None and obj.spec.selector is not None and obj.spec.selector.match_labels:
                    selector = ",".join(f"{k}={v}" for k, v in obj.spec.selector.match_labels.items())
                    watch = PodWatch(client.CoreV1Api(self._client(step.context)), namespace, selector)
                rows = watch.rows() if watch is not None else []
                if live is not None:
                    live.update(table(rows, f"{kind.lower()}/{name}: {state}"), refresh=True)
                for r in rows:
                    if live is None and shown.get((r.pod, r.container)) != (r.stage, r.detail):
                        shown[(r.pod, r.container)] = (r.stage, r.detail)
                        detail = f" ({r.detail})" if r.detail else ""
                        console.print(f"      {r.pod}/{r.container}: {r.stage}{detail}", highlight=False, markup=False)
                if time.monotonic() > deadline:
                    stuck = "; ".join(f"{r.pod}: {r.stage}" for r in rows if r.stage != "ready")
                    raise StackError(f"{kind}/{name} not rolled out after {step.timeout_s:.0f}s ({state}"
                                     f"{'; ' + stuck if stuck else ''}); see `kubectl -n {namespace} describe pods` "
                                     "and docs/kind.md 'Troubleshooting'")
                time.sleep(2)

    def _preflight(self, step: Step) -> None:
        from kubernetes import client

        from kvlab.stack.kind import preflight

        assert step.topology is not None and step.cluster is not None
        core = client.CoreV1Api(self._client(step.context))
        def say(line: str) -> None:
            print(line, file=self.out, flush=True)

        passed, lines = preflight.report(preflight.run(core, step.cluster, step.topology, say, step.timeout_s))
        for line in lines:
            say(f"    {line}")
        if not passed:
            raise StackError("preflight failed (above): fix it, then `kvlab cluster preflight --topology "
                             f"{step.topology.name}`; see docs/kind.md, 'Troubleshooting'")

    def _gpus(self, step: Step) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self._client(step.context))
        deadline = time.monotonic() + step.timeout_s
        while time.monotonic() < deadline:
            for node in core.list_node().items:
                allocatable = (node.status.allocatable if node.status else None) or {}
                count = int(allocatable.get("nvidia.com/gpu", "0"))
                if count > 0:
                    name = node.metadata.name if node.metadata else "?"
                    print(f"    {name}: {count} GPU(s) allocatable", file=self.out, flush=True)
                    return
            time.sleep(3)
        raise StackError("no node reports allocatable nvidia.com/gpu: check the device plugin logs "
                         "(kubectl -n nvidia-device-plugin logs ds/nvidia-device-plugin) and docs/kind.md")


def rollout_state(kind: str, obj: Any) -> tuple[bool, str]:
    """(done, human-readable progress) of a Deployment or DaemonSet status object."""
    status = obj.status
    generation_seen = (status.observed_generation or 0) >= (obj.metadata.generation or 0)
    if kind == "Deployment":
        want = obj.spec.replicas if obj.spec.replicas is not None else 1
        updated, available = status.updated_replicas or 0, status.available_replicas or 0
        done = generation_seen and updated == want and available == want and (status.replicas or 0) == want
        return done, f"{available}/{want} available, {updated} updated"
    want = status.desired_number_scheduled or 0
    updated, available = status.updated_number_scheduled or 0, status.number_available or 0
    done = generation_seen and updated == want and available == want
    return done, f"{available}/{want} available, {updated} updated"
