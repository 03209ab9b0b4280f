"""What a rollout shows while vLLM pods start (stack/kind/startup.py), against real kubernetes
client objects (V1Pod, CoreV1Event, V1Deployment) and log lines in vLLM 0.32's wording: the
messages below are the format strings of the installed vLLM 0.32 (module:line in `MILESTONES`),
filled in the way its logger prints them."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

import pytest

from conftest import IN_CI

if not IN_CI:
    pytest.importorskip("kubernetes")

from kubernetes.client import (
    CoreV1Event,
    CoreV1EventList,
    V1Container,
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Deployment,
    V1DeploymentSpec,
    V1DeploymentStatus,
    V1LabelSelector,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSpec,
    V1PodStatus,
    V1PodTemplateSpec,
)
from kubernetes.client.exceptions import ApiException

from kvlab.stack.kind import runner as runner_mod
from kvlab.stack.kind.plan import Step
from kvlab.stack.kind.startup import PodWatch, from_log, table

E, A = "(EngineCore pid=211)", "(APIServer pid=1)"
VLLM_LOG = [
    f"{A} INFO 11-23 04:01:02 [entry.py:120] vLLM API server version 0.32.0",
    f"{E} INFO 11-23 04:01:20 [gpu_model_runner.py:5040] Starting to load model Qwen/Qwen3-0.6B...",
    f"{E} INFO 11-23 04:03:50 [weight_utils.py:533] Time spent downloading weights for Qwen/Qwen3-0.6B: 150.123456 seconds",
    "Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]",
    "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  3.10it/s]",
    f"{E} INFO 11-23 04:03:51 [default_loader.py:502] Loading weights took 0.35 seconds",
    f"{E} INFO 11-23 04:03:52 [gpu_model_runner.py:5150] Model loading took 1.12 GiB memory and 151.201337 seconds",
    f"{E} INFO 11-23 04:04:01 [kv_cache_utils.py:2328] GPU KV cache size: 16,384 tokens, "
    "Maximum concurrency for 4,096 tokens per request: 4.00x",
    f"{E} INFO 11-23 04:04:20 [core.py:403] init engine (profile, create kv cache, warmup model) took 28.31 s",
    f"{A} INFO 11-23 04:04:22 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000",
    f"{A} INFO:     Application startup complete.",
]
EXPECTED = [None, None, ("downloading weights", "Qwen/Qwen3-0.6B"),
            ("loading weights", "Qwen/Qwen3-0.6B: 150.123456 seconds"), ("loading weights", "0/1 shards (0 %)"),
            ("loading weights", "1/1 shards (100 %)"), ("loading weights", "1/1 shards (100 %)"),
            ("profiling memory", "1.12 GiB memory and 151.201337 seconds"), ("warming up", "16,384 tokens"),
            ("starting the API server", ""), ("starting the API server", ""), ("serving", "")]


def test_a_vllm_log_moves_through_its_milestones_in_order():
    assert [from_log("\n".join(VLLM_LOG[:n])) for n in range(len(VLLM_LOG) + 1)] == EXPECTED


def test_tqdm_carriage_returns_count_as_lines():
    text = "\r".join(["Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01,  1.0it/s]",
                      "Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:02<00:00,  1.0it/s]"])
    assert from_log(VLLM_LOG[1] + "\n" + text) == ("loading weights", "2/2 shards (100 %)")


T0 = datetime(2026, 11, 23, 4, 0, tzinfo=UTC)
IMAGE = "vllm/vllm-openai:v0.32.0"


def _event(pod: str, reason: str, message: str, minute: int) -> CoreV1Event:
    return CoreV1Event(metadata=V1ObjectMeta(name=f"{pod}.{minute}", namespace="kvlab"), reason=reason,
                       message=message, type="Normal", last_timestamp=T0 + timedelta(minutes=minute),
                       involved_object=V1ObjectReference(kind="Pod", name=pod, namespace="kvlab"))


def _pod(name: str, state: V1ContainerState | None, ready: bool = False, scheduled: bool = True,
         last: V1ContainerState | None = None, restarts: int = 0) -> V1Pod:
    conditions = [V1PodCondition(type="PodScheduled", status="True" if scheduled else "False",
                                 reason=None if scheduled else "Unschedulable",
                                 message=None if scheduled else "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")]
    if scheduled:
        conditions.append(V1PodCondition(type="Ready", status="True" if ready else "False"))
    statuses = None if state is None else [V1ContainerStatus(name="vllm", image=IMAGE, image_id="", ready=ready,
                                                             restart_count=restarts, state=state, last_state=last)]
    return V1Pod(metadata=V1ObjectMeta(name=name, namespace="kvlab", labels={"app.kubernetes.io/component": "replica"}),
                 spec=V1PodSpec(containers=[V1Container(name="vllm", image=IMAGE)]),
                 status=V1PodStatus(phase="Running" if state and state.running else "Pending",
                                    conditions=conditions, container_statuses=statuses))


def _waiting(reason: str, message: str = "") -> V1ContainerState:
    return V1ContainerState(waiting=V1ContainerStateWaiting(reason=reason, message=message))


RUNNING = V1ContainerState(running=V1ContainerStateRunning(started_at=T0))


class FakeCore:
    """list pods / events and read logs, as CoreV1Api answers them; `logs` grow as vLLM writes."""

    def __init__(self, pods: list[V1Pod], events: list[CoreV1Event], logs: dict[str, str]) -> None:
        self.pods, self.events, self.logs = pods, events, logs
        self.selectors: list[str] = []

    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **_) -> V1PodList:
        self.selectors.append(label_selector)
        return V1PodList(items=self.pods)

    def list_namespaced_event(self, namespace: str, field_selector: str = "", **_) -> CoreV1EventList:
        name = field_selector.split("involvedObject.name=")[1]
        assert "involvedObject.kind=Pod" in field_selector
        return CoreV1EventList(items=[e for e in self.events if e.involved_object.name == name])

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str = "", tail_lines: int = 0, **_) -> str:
        if name not in self.logs:
            raise ApiException(status=400, reason="Bad Request")   # container not running yet
        return "\n".join(self.logs[name].splitlines()[-tail_lines:])


def _cluster() -> FakeCore:
    pods = [
        _pod("r-a-pending", None, scheduled=False),
        _pod("r-b-pulling", _waiting("ContainerCreating")),
        _pod("r-c-badimage", _waiting("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"')),
        _pod("r-d-download", RUNNING),
        _pod("r-e-oom", _waiting("CrashLoopBackOff", "back-off 40s restarting failed container"), restarts=3,
             last=V1ContainerState(terminated=V1ContainerStateTerminated(reason="OOMKilled", exit_code=137))),
        _pod("r-f-ready", RUNNING, ready=True),
        _pod("r-g-pulled", _waiting("ContainerCreating")),
    ]
    events = [_event("r-b-pulling", "Scheduled", "Successfully assigned kvlab/r-b-pulling to kvlab-worker", 0),
              _event("r-b-pulling", "Pulling", f'Pulling image "{IMAGE}"', 1),
              _event("r-g-pulled", "Pulled", f'Successfully pulled image "{IMAGE}" in 3m2.1s', 4),
              _event("r-g-pulled", "Pulling", f'Pulling image "{IMAGE}"', 1)]
    return FakeCore(pods, events, {"r-d-download": "\n".join(VLLM_LOG[:2]), "r-f-ready": "\n".join(VLLM_LOG)})


def test_each_pod_says_what_it_is_waiting_for():
    now = [100.0]
    core = _cluster()
    watch = PodWatch(core, "kvlab", "app.kubernetes.io/component=replica", clock=lambda: now[0])
    rows = {r.pod: (r.stage, r.detail) for r in watch.rows()}
    assert rows == {
        "r-a-pending": ("unschedulable", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."),
        "r-b-pulling": ("pulling image", f'Pulling image "{IMAGE}"'),
        "r-c-badimage": ("image pull failed", f'ImagePullBackOff: Back-off pulling image "{IMAGE}"'),
        "r-d-download": ("downloading weights", "Qwen/Qwen3-0.6B"),
        "r-e-oom": ("crashing", "restarts 3, last: OOMKilled (exit 137)"),
        "r-f-ready": ("ready", ""),
        "r-g-pulled": ("creating container", "ContainerCreating"),   # its last pull event is Pulled
    }
    assert core.selectors == ["app.kubernetes.io/component=replica"]
    # time in a stage counts from when the watch first saw it, and restarts when the stage changes
    now[0] = 190.0
    core.logs["r-d-download"] = "\n".join(VLLM_LOG[:5])
    seconds = {r.pod: (r.stage, r.seconds) for r in watch.rows()}
    assert seconds["r-b-pulling"] == ("pulling image", 90.0)
    assert seconds["r-d-download"] == ("loading weights", 0.0)
    text = io.StringIO()
    from rich.console import Console

    Console(file=text, width=200).print(table(watch.rows(), "deployment/x"))
    assert "r-d-download" in text.getvalue() and "1/1 shards (100 %)" in text.getvalue()


class FakeApps:
    def __init__(self, core: FakeCore) -> None:
        self.core, self.reads = core, 0

    def read_namespaced_deployment_status(self, name: str, namespace: str) -> V1Deployment:
        self.reads += 1
        if self.reads == 3:     # vLLM got further between polls
            self.core.logs["r-d-download"] = "\n".join(VLLM_LOG[:7])
        available = 2 if self.reads >= 4 else 0
        return V1Deployment(metadata=V1ObjectMeta(name=name, namespace=namespace, generation=1),
                            spec=V1DeploymentSpec(replicas=2, selector=V1LabelSelector(match_labels={"app": "x"}),
                                                  template=V1PodTemplateSpec()),
                            status=V1DeploymentStatus(observed_generation=1, replicas=2, updated_replicas=2,
                                                      available_replicas=available))


def test_a_rollout_wait_prints_each_pods_stage_as_it_changes(monkeypatch):
    from kubernetes import client

    core = _cluster()
    core.pods = [p for p in core.pods if p.metadata.name in ("r-b-pulling", "r-d-download")]
    apps = FakeApps(core)
    monkeypatch.setattr(client, "AppsV1Api", lambda _api: apps)
    monkeypatch.setattr(client, "CoreV1Api", lambda _api: core)
    monkeypatch.setattr(runner_mod.Runner, "_client", lambda self, context: object())
    monkeypatch.setattr(runner_mod.time, "sleep", lambda _s: None)
    out = io.StringIO()
    runner_mod.Runner(out)._rollout(Step(action="rollout", what="rollout", context="kind-kvlab", kind="Deployment",
                                         name="kvlab-replicas", namespace="kvlab", timeout_s=60))
    lines = out.getvalue().splitlines()
    assert lines[0].strip() == "deployment/kvlab-replicas: 0/2 available, 2 updated"
    assert f'r-b-pulling/vllm: pulling image (Pulling image "{IMAGE}")' in out.getvalue()
    download = lines.index("      r-d-download/vllm: downloading weights (Qwen/Qwen3-0.6B)")
    profiling = lines.index("      r-d-download/vllm: profiling memory (1.12 GiB memory and 151.201337 seconds)")
    assert download < profiling                    # printed once each, when the stage changed
    assert sum("pulling image" in x for x in lines) == 1
    assert lines[-1].strip() == "deployment/kvlab-replicas: 2/2 available, 2 updated"
    assert core.selectors and set(core.selectors) == {"app=x"}


def test_a_rollout_that_times_out_names_the_stuck_pods(monkeypatch):
    from kubernetes import client

    from kvlab.errors import StackError

    core = _cluster()
    core.pods = [p for p in core.pods if p.metadata.name == "r-a-pending"]
    apps = FakeApps(core)
    apps.reads = -10**6      # never available
    monkeypatch.setattr(client, "AppsV1Api", lambda _api: apps)
    monkeypatch.setattr(client, "CoreV1Api", lambda _api: core)
    monkeypatch.setattr(runner_mod.Runner, "_client", lambda self, context: object())
    monkeypatch.setattr(runner_mod.time, "sleep", lambda _s: None)
    with pytest.raises(StackError, match="r-a-pending: unschedulable"):
        runner_mod.Runner(io.StringIO())._rollout(Step(action="rollout", what="rollout", context="k",
                                                       kind="Deployment", name="d", namespace="kvlab", timeout_s=0))
