"""Executes a plan: commands through subprocess, cluster steps through the `kubernetes` client."""

from __future__ import annotations

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
        return config.new_client_from_config(context=context)
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

        dyn = DynamicClient(self._client(step.context))
        for manifest in step.manifests:
            resource = dyn.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
            meta = manifest["metadata"]
            try:
                resource.server_side_apply(body=manifest, name=meta["name"], namespace=meta.get("namespace"),
                                           field_manager=FIELD_MANAGER, force_conflicts=True)
            except DynamicApiError as exc:
                raise StackError(f"apply {manifest['kind']}/{meta['name']} failed: {exc.summary()}") from None
            print(f"    applied {manifest['kind'].lower()}/{meta['name']}", file=self.out, flush=True)

    def _rollout(self, step: Step) -> None:
        from kubernetes import client

        apps = client.AppsV1Api(self._client(step.context))
        read = apps.read_namespaced_deployment_status if step.kind == "Deployment" else apps.read_namespaced_daemon_set_status
        deadline = time.monotonic() + step.timeout_s
        last = ""
        while True:
            obj = read(step.name, step.namespace)
            done, state = rollout_state(step.kind or "", obj)
            if state != last:
                print(f"    {step.kind.lower()}/{step.name}: {state}", file=self.out, flush=True)  # type: ignore[union-attr]
                last = state
            if done:
                return
            if time.monotonic() > deadline:
                raise StackError(f"{step.kind}/{step.name} not rolled out after {step.timeout_s:.0f}s ({state}); "
                                 f"see `kubectl -n {step.namespace} describe pods` and docs/kind.md 'Troubleshooting'")
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
                count = int((node.status.allocatable or {}).get("nvidia.com/gpu", "0"))
                if count > 0:
                    print(f"    {node.metadata.name}: {count} GPU(s) allocatable", file=self.out, flush=True)
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
