"""KubernetesDiscovery against a fake CoreV1Api that serves the client's real model objects.

The fake answers `list_namespaced_pod` with a real V1PodList and, for watch calls, with a
streaming response of JSON lines that the real `kubernetes.watch.Watch` parses back into V1Pod
objects, so the discovery runs the same code path as against an API server.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading

import pytest

from conftest import IN_CI

if not IN_CI:  # in CI a missing client fails at import instead of skipping
    pytest.importorskip("kubernetes")
from kubernetes.client import (
    ApiClient,
    V1ListMeta,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodStatus,
)
from kubernetes.client.rest import ApiException

from kvlab.contract import Endpoint
from kvlab.gateway.discovery.kubernetes import KubernetesDiscovery, endpoints_of

SELECTOR = "app.kubernetes.io/part-of=kvlab,app.kubernetes.io/component=replica"


def pod(name: str, ip: str | None = "10.244.1.5", ready: bool = True, role: str | None = None,
        phase: str = "Running", dp: int | None = None, rv: str = "1") -> V1Pod:
    labels = {"app.kubernetes.io/component": "replica"}
    if role:
        labels["kvlab.io/role"] = role
    annotations = {"kvlab.io/data-parallel-size": str(dp)} if dp else None
    return V1Pod(
        metadata=V1ObjectMeta(name=name, namespace="kvlab", labels=labels, annotations=annotations, resource_version=rv),
        status=V1PodStatus(phase=phase, pod_ip=ip,
                           conditions=[V1PodCondition(type="Ready", status="True" if ready else "False")]),
    )


class _Stream:
    """A urllib3-like streaming response: `stream()` yields JSON lines until closed."""

    def __init__(self, lines: queue.Queue[bytes | None]) -> None:
        self.lines = lines
        self.status = 200

    def stream(self, amt=None, decode_content=False):
        while True:
            item = self.lines.get()
            if item is None:
                return
            yield item

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class FakeCoreV1Api:
    """list_namespaced_pod: a list from `self.pods`; with watch=True, events pushed by the test."""

    def __init__(self, pods: list[V1Pod]) -> None:
        self.pods = pods
        self.calls: list[dict] = []
        self.watches: queue.Queue[queue.Queue] = queue.Queue()
        self.fail_next_list = 0
        self._client = ApiClient()

    def list_namespaced_pod(self, namespace: str, **kwargs) -> V1PodList:
        self.calls.append({"namespace": namespace, **kwargs})
        if kwargs.get("watch"):
            lines: queue.Queue = queue.Queue()
            self.watches.put(lines)
            return _Stream(lines)  # type: ignore[return-value]
        if self.fail_next_list:
            self.fail_next_list -= 1
            raise ApiException(status=503, reason="apiserver unavailable")
        return V1PodList(items=list(self.pods), metadata=V1ListMeta(resource_version="7"))

    def event(self, lines: queue.Queue, kind: str, obj: V1Pod) -> None:
        raw = self._client.sanitize_for_serialization(obj)
        lines.put((json.dumps({"type": kind, "object": raw}) + "\n").encode())


async def _next(changes: asyncio.Queue, timeout: float = 5.0) -> list[Endpoint]:
    return await asyncio.wait_for(changes.get(), timeout)


def _watch_lines(api: FakeCoreV1Api) -> queue.Queue:
    return api.watches.get(timeout=5)


@pytest.mark.timeout(30)
def test_list_then_watch_ready_pods_only():
    api = FakeCoreV1Api([pod("r-0", "10.0.0.1"), pod("r-1", "10.0.0.2", ready=False), pod("r-2", None),
                         pod("p-0", "10.0.0.4", role="prefill")])
    disc = KubernetesDiscovery("kvlab", SELECTOR, api_port=8000, kv_events_port=5557, api=api)

    async def main() -> None:
        changes: asyncio.Queue = asyncio.Queue()

        async def on_change(eps: list[Endpoint]) -> None:
            await changes.put(eps)

        task = asyncio.create_task(disc.run(on_change))
        try:
            first = await _next(changes)
            assert first == [
                Endpoint(name="p-0", url="http://10.0.0.4:8000", kv_events="tcp://10.0.0.4:5557", role="prefill"),
                Endpoint(name="r-0", url="http://10.0.0.1:8000", kv_events="tcp://10.0.0.1:5557", role="both"),
            ]
            lines = await asyncio.to_thread(_watch_lines, api)
            # r-1 becomes ready: the full set grows
            api.event(lines, "MODIFIED", pod("r-1", "10.0.0.2", rv="8"))
            second = await _next(changes)
            assert [e.name for e in second] == ["p-0", "r-0", "r-1"]
            # r-0 is deleted, p-0 turns unready
            api.event(lines, "DELETED", pod("r-0", "10.0.0.1", rv="9"))
            assert [e.name for e in await _next(changes)] == ["p-0", "r-1"]
            api.event(lines, "MODIFIED", pod("p-0", "10.0.0.4", ready=False, role="prefill", rv="10"))
            assert [e.name for e in await _next(changes)] == ["r-1"]
            # an event that changes nothing visible does not call on_change
            api.event(lines, "MODIFIED", pod("r-1", "10.0.0.2", rv="11"))
            api.event(lines, "ADDED", pod("r-3", "10.0.0.3", rv="12"))
            assert [e.name for e in await _next(changes)] == ["r-1", "r-3"]
        finally:
            disc.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    first_list = api.calls[0]
    assert first_list == {"namespace": "kvlab", "label_selector": SELECTOR}
    watch_call = next(c for c in api.calls if c.get("watch"))
    assert watch_call["label_selector"] == SELECTOR and watch_call["resource_version"] == "7"


@pytest.mark.timeout(30)
def test_reconnects_after_errors_with_backoff():
    api = FakeCoreV1Api([pod("r-0", "10.0.0.1")])
    api.fail_next_list = 2
    disc = KubernetesDiscovery("kvlab", SELECTOR, api=api, backoff_s=(0.01, 0.05))

    async def main() -> None:
        changes: asyncio.Queue = asyncio.Queue()

        async def on_change(eps: list[Endpoint]) -> None:
            await changes.put(eps)

        task = asyncio.create_task(disc.run(on_change))
        try:
            assert [e.name for e in await _next(changes)] == ["r-0"]
            lines = await asyncio.to_thread(_watch_lines, api)
            # the watch breaks (410 Gone twice makes the client raise): discovery re-lists
            api.pods = [pod("r-0", "10.0.0.1"), pod("r-5", "10.0.0.9")]
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError",
                                                "message": "boom"}}
            lines.put((json.dumps(gone) + "\n").encode())
            assert [e.name for e in await _next(changes)] == ["r-0", "r-5"]
        finally:
            disc.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    lists = [c for c in api.calls if not c.get("watch")]
    assert len(lists) >= 4  # 2 failures, the first success, the re-list after the broken watch


def test_data_parallel_ranks_and_ipv6():
    pods = {"w-0": pod("w-0", "fd00::5", dp=2, role="decode")}
    eps = endpoints_of(pods, 8000, 5557)
    assert eps == [
        Endpoint(name="w-0-dp0", url="http://[fd00::5]:8000", kv_events="tcp://[fd00::5]:5557", role="decode",
                 dp_rank=0, replica="w-0"),
        Endpoint(name="w-0-dp1", url="http://[fd00::5]:8001", kv_events="tcp://[fd00::5]:5558", role="decode",
                 dp_rank=1, replica="w-0"),
    ]
    assert endpoints_of({"x": pod("x", "10.0.0.1")}, 9000, None)[0].kv_events is None
    terminating = pod("t", "10.0.0.1")
    terminating.metadata.deletion_timestamp = "2026-01-01T00:00:00Z"
    assert endpoints_of({"t": terminating, "f": pod("f", "10.0.0.2", phase="Failed")}, 8000, 5557) == []


def test_stop_ends_the_thread():
    api = FakeCoreV1Api([])
    disc = KubernetesDiscovery("kvlab", SELECTOR, api=api)
    seen = threading.Event()

    async def main() -> None:
        async def on_change(eps: list[Endpoint]) -> None:
            seen.set()

        task = asyncio.create_task(disc.run(on_change))
        lines = await asyncio.to_thread(_watch_lines, api)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        lines.put(None)  # the server side of the watch closes

    asyncio.run(main())
    assert seen.is_set()
    assert disc._stop.is_set()
