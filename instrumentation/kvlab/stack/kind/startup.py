"""What each pod of a rollout is doing while it starts: read from the pod, its events and its log.

A GPU rollout can sit for many minutes: the vLLM image (several GB) pulls, the model downloads
into the cache, vLLM loads the weights, profiles memory, sizes its KV cache and warms up. The
Deployment's status says "0/4 available" all along. vLLM 0.32 downloads with its progress bar
disabled (`DisabledTqdm` in `model_executor/model_loader/weight_utils.py`), so a download shows
as the time since "Starting to load model" with no later milestone yet; the milestones are
vLLM 0.32's own log messages (module and message quoted in `MILESTONES`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

# (what a vLLM 0.32 log line contains, the stage it starts); later entries win
MILESTONES = (
    ("Starting to load model", "downloading weights"),        # v1/worker/gpu_model_runner.py (cpu_: too)
    ("Time spent downloading weights", "loading weights"),    # model_loader/weight_utils.py, download > 0.5 s
    ("Loading safetensors checkpoint shards", "loading weights"),   # its tqdm bar (weight_utils.py)
    ("Model loading took", "profiling memory"),               # gpu_model_runner.py: GiB and seconds
    ("KV cache size:", "warming up"),                         # v1/core/kv_cache_utils.py: "GPU KV cache size: N tokens"
    ("init engine (profile, create kv cache, warmup model) took", "starting the API server"),   # v1/engine/core.py
    ("Application startup complete", "serving"),              # uvicorn, once vLLM's app is up
)
SHARDS = re.compile(r"Loading safetensors checkpoint shards[^:]*:\s*(\d+)% Completed \| (\d+)/(\d+)")
DETAILS = (re.compile(r"Starting to load model (\S+?)(?:\.\.\.)?$"), re.compile(r"Model loading took (.+)$"),
           re.compile(r"KV cache size: ([\d,]+ tokens)"), re.compile(r"Time spent downloading weights for (.+)$"))
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")
LOG_LINES = 300
COLOURS = {"ready": "green", "crashing": "red", "image pull failed": "red", "unschedulable": "red"}


class Row(NamedTuple):
    """One container of one pod: its stage, what it says about it, seconds in that stage."""

    pod: str
    container: str
    stage: str
    detail: str
    seconds: float


def from_log(text: str) -> tuple[str, str] | None:
    """(stage, detail) from the tail of a vLLM log; None before its first milestone."""
    stage: str | None = None
    detail = ""
    for raw in text.replace("\r", "\n").splitlines():
        line = raw.rstrip()
        for needle, name in MILESTONES:
            if needle in line:
                stage = name
                shards = SHARDS.search(line)
                found = next((m for m in (p.search(line) for p in DETAILS) if m), None)
                detail = (f"{shards.group(2)}/{shards.group(3)} shards ({shards.group(1)} %)" if shards
                          else found.group(1) if found else "")
    return (stage, detail) if stage else None


def _events(events: list[Any]) -> list[Any]:
    def when(e: Any) -> float:
        t = e.last_timestamp or e.event_time or e.metadata.creation_timestamp
        return t.timestamp() if t is not None else 0.0

    return sorted(events, key=when)


def from_status(pod: Any, container: str, events: list[Any]) -> tuple[str, str] | None:
    """(stage, detail) from the pod's status and events; None once the container runs (read its log)."""
    status = pod.status
    for cond in status.conditions or ():
        if cond.type == "PodScheduled" and cond.status == "False":
            return "unschedulable", cond.message or cond.reason or ""
    state = next((s for s in status.container_statuses or () if s.name == container), None)
    if state is None or state.state is None:
        return "scheduling", ""
    if state.state.waiting is not None:
        reason, message = state.state.waiting.reason or "", state.state.waiting.message or ""
        if reason in PULL_FAILURES:
            return "image pull failed", f"{reason}: {message}"
        if reason == "CrashLoopBackOff":
            last = state.last_state.terminated if state.last_state else None
            why = f"{last.reason} (exit {last.exit_code})" if last else message
            return "crashing", f"restarts {state.restart_count}, last: {why}"
        pulls = [e for e in _events(events) if e.reason in ("Pulling", "Pulled")]
        if pulls and pulls[-1].reason == "Pulling":
            return "pulling image", pulls[-1].message or ""
        return "creating container", reason
    if state.state.terminated is not None:
        t = state.state.terminated
        return "exited", f"{t.reason} (exit {t.exit_code})"
    return None


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ())


class PodWatch:
    """Polls the pods behind a label selector; `rows()` says what each container does now."""

    def __init__(self, core: Any, namespace: str, selector: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.core, self.namespace, self.selector, self.clock = core, namespace, selector, clock
        self._since: dict[tuple[str, str], tuple[str, float]] = {}

    def _log(self, pod: str, container: str) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            return str(self.core.read_namespaced_pod_log(pod, self.namespace, container=container,
                                                         tail_lines=LOG_LINES, _request_timeout=10))
        except ApiException:    # 400 while the container is not running yet
            return ""

    def rows(self) -> list[Row]:
        out: list[Row] = []
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector).items
        for pod in sorted(pods, key=lambda p: p.metadata.name):
            name = pod.metadata.name
            events = self.core.list_namespaced_event(
                self.namespace, field_selector=f"involvedObject.kind=Pod,involvedObject.name={name}").items
            for c in pod.spec.containers:
                found = from_status(pod, c.name, events)
                if found is None:
                    found = ("ready", "") if _ready(pod) else from_log(self._log(name, c.name)) or ("starting", "")
                stage, detail = found
                key = (name, c.name)
                if self._since.get(key, ("", 0.0))[0] != stage:
                    self._since[key] = (stage, self.clock())
                out.append(Row(name, c.name, stage, detail, self.clock() - self._since[key][1]))
        return out


def table(rows: list[Row], title: str) -> Any:
    """The rows as a rich Table (one line per container)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", expand=False)
    for col in ("pod", "container", "stage", "for", "detail"):
        t.add_column(col, overflow="fold")
    for r in rows:
        colour = COLOURS.get(r.stage, "")
        t.add_row(r.pod, r.container, f"[{colour}]{r.stage}[/]" if colour else r.stage, f"{r.seconds:.0f}s", r.detail)
    return t
