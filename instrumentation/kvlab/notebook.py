"""Display helpers shared by the lab notebooks (labs/0*.ipynb); the teaching stays in the notebooks.

The only state shared between notebooks is the run directory: `ensure_stack` attaches to the
stack runs/latest/stack.json describes when it is healthy (else starts one with `kvlab up`, or, for
the kind targets, records the deployed cluster; kvlab.stack.attached), and every phase a notebook
runs goes through the same `run_phases` as `kvlab lab` into that run dir (phase-N-<policy>/), so
`kvlab traces`, the report and the next notebook find it. What is left here is what a notebook
shows: progress bars, replica load samples, traces and dashboard panels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from kvlab.errors import StackError
from kvlab.load.measure import Record, read_records
from kvlab.load.runner import Progress as Watch
from kvlab.load.spec import BenchSpec
from kvlab.load.summary import read_summary
from kvlab.process import Child
from kvlab.run.phases import Phase, PhaseResult, run_phases
from kvlab.run.presets import LAB_QUICK
from kvlab.stack import attached
from kvlab.stack.attached import PROCESSES_FILE, TARGETS, AttachedStack
from kvlab.stack.base import StackInfo, read_info
from kvlab.stack.launch import KVLAB
from kvlab.stack.state import runs_dir, write_json
from kvlab.telemetry import names as n

__all__ = ["PROCESSES_FILE", "TARGETS", "LabPhase", "dashboard_panel", "ensure_stack", "gateway", "healthy",
           "load_phase", "phase", "phase_dir", "replica_metrics", "reset_caches", "run_env", "run_lab", "run_phase",
           "runs_root", "setup", "stop_stack", "wait_trace"]

QUICK_DURATION_S = LAB_QUICK.duration_s
QUICK_USERS = LAB_QUICK.users


def setup() -> Path:
    """First cell of every notebook: plotly figures that render in JupyterLab and in the
    notebook's HTML export (plotly.js inlined once), and the runs/ folder; returns it."""
    import plotly.io as pio

    pio.renderers.default = "plotly_mimetype+notebook"
    return runs_root()


def runs_root() -> Path:
    """$KVLAB_RUNS_DIR, else runs/ at the repository root (notebooks run with cwd labs/).

    Exported as KVLAB_RUNS_DIR so `kvlab up`/`kvlab down` started from here agree."""
    if not os.environ.get("KVLAB_RUNS_DIR"):
        here = Path.cwd().absolute()
        repo = next((p for p in (here, *here.parents) if (p / "pyproject.toml").is_file() and (p / "labs").is_dir()),
                    here)
        os.environ["KVLAB_RUNS_DIR"] = str(repo / "runs")
    return runs_dir()


def healthy(stack: StackInfo | None) -> bool:
    """A running stack whose gateway (and, locally, every replica) answers /health."""
    return attached.healthy(stack)


def ensure_stack(target: str = "local", topology: str = "quickstart", timeout_s: float = 180.0) -> StackInfo:
    """The stack of runs/latest when it is healthy and runs `topology`; else a fresh one. Its
    stack.json, typed: `stack.gateway`, `stack.replicas[0].url`, `stack.run_dir`, `stack.topology`.

    local: `kvlab up --topology T` (a different local topology still running is stopped first).
    kind-cpu / kind-gpu: the cluster must be deployed (docs/kind.md); this only records its URLs.
    """
    return attached.ensure(target, topology, runs_root(), timeout_s)


def stop_stack(run_dir: Path | None = None) -> None:
    """`kvlab down` for a local run dir (default runs/latest) plus any process a notebook recorded."""
    attached.stop(Path(run_dir) if run_dir else runs_root() / "latest")


def reset_caches(stack: StackInfo) -> int:
    """Empty every replica's prefix cache (a phase starts cold): locally POST /reset_prefix_cache,
    on kind through the API server's pod proxy; returns how many were reset."""
    return sum(1 for why in AttachedStack(stack).reset_caches().values() if why is None)


@contextmanager
def gateway(stack: StackInfo, policy: str) -> Iterator[str]:
    """Base URL of a gateway routing with `policy` in front of the stack's replicas.

    The stack's own gateway when its policy matches; locally, else, a `kvlab gateway` started for
    the duration of the `with` block (stopped by pid on exit). On kind, round-robin means the
    plain Service (`baseline`, kube-proxy) and kv-aware the kvlab gateway."""
    stack_ = AttachedStack(stack)
    try:
        yield stack_.gateway_for(policy)
    finally:
        stack_.stop()


# ---- engine metrics ---------------------------------------------------------------------------------
def replica_metrics(stack: StackInfo) -> dict[str, dict[str, float]]:
    """Per local replica: running, waiting, kv_usage, prefix-cache queries and hits (vLLM names)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {n.VLLM_NUM_REQUESTS_RUNNING: "running", n.VLLM_NUM_REQUESTS_WAITING: "waiting",
              n.VLLM_KV_CACHE_USAGE: "kv_usage", n.VLLM_PREFIX_CACHE_QUERIES + "_total": "queries",
              n.VLLM_PREFIX_CACHE_HITS + "_total": "hits"}
    out: dict[str, dict[str, float]] = {}
    for r in stack.replicas:
        values = dict.fromkeys(wanted.values(), 0.0)
        try:
            with urllib.request.urlopen(f"{r.url}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        usage: list[float] = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == n.VLLM_KV_CACHE_USAGE:
                    usage.append(sample.value)   # a fraction per engine: averaged, not summed
                elif sample.name in wanted:
                    values[wanted[sample.name]] += sample.value
        values["kv_usage"] = sum(usage) / len(usage) if usage else 0.0
        out[r.name] = values
    return out


# ---- phases --------------------------------------------------------------------------------------------
class _Progress:
    """An in-place progress bar in the notebook (plain text where there is no display)."""

    def __init__(self, label: str, total_s: float, stack: StackInfo) -> None:
        from IPython.display import HTML, display

        self.label, self.total_s, self.stack, self._html = label, total_s, stack, HTML
        self.handle = display(HTML(self._render(0.0, [])), display_id=True)  # type: ignore[no-untyped-call]  # IPython.display is untyped
        self.samples: list[dict[str, Any]] = []
        self._next = 0.0

    def _render(self, elapsed: float, records: list[Record]) -> str:
        ok = sorted(r.ttft_ms for r in records if not r.error and r.ttft_ms is not None)
        p50 = f"{ok[len(ok) // 2]:.0f} ms" if ok else "–"
        errors = sum(1 for r in records if r.error)
        done = min(elapsed, self.total_s)
        return (f"<b>{self.label}</b> <progress value='{done:.1f}' max='{self.total_s:.1f}'></progress> "
                f"{done:.0f}/{self.total_s:.0f} s · {len(records)} requests · TTFT p50 {p50} · {errors} errors")

    def __call__(self, elapsed: float, records: list[Record]) -> None:
        if elapsed >= self._next:      # sample replica load about once a second
            self._next = elapsed + 1.0
            for name, m in replica_metrics(self.stack).items():
                self.samples.append({"t": round(elapsed, 2), "replica": name, **m})
            if self.handle is not None:
                self.handle.update(self._html(self._render(elapsed, records)))  # type: ignore[no-untyped-call]  # IPython.display is untyped


class _Display:
    """run_phases' Display in a notebook: a `_Progress` per phase (its replica samples kept)."""

    def __init__(self, stack: StackInfo) -> None:
        self.stack = stack
        self.progress: _Progress | None = None

    def begin(self, number: int, phase: Phase, total_s: float) -> Watch:
        self.progress = _Progress(f"phase {number}: {phase.name}", total_s, self.stack)
        return self.progress

    def end(self) -> None:
        pass


class LabPhase(PhaseResult, kw_only=True):
    """A phase as a notebook shows it: its result plus the replicas' load, sampled about once a
    second, and the engines' prefix-cache queries/hits counted during it (replica-samples.json)."""

    samples: list[dict[str, Any]] = msgspec.field(default_factory=list)
    engines: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)


def phase_dir(stack: StackInfo, policy: str) -> Path | None:
    """The newest phase-N-<policy>/ with a summary in the stack's run dir."""
    found = sorted(Path(stack.run_dir).glob(f"phase-*-{policy}/summary.json"),
                   key=lambda p: int(p.parent.name.split("-")[1]))
    return found[-1].parent if found else None


def run_phase(stack: StackInfo, policy: str, *, workload: str = "shared-prefix",
              params: dict[str, Any] | None = None, users: int = QUICK_USERS,
              duration_s: float = QUICK_DURATION_S, seed: int = 0, min_requests: int = 0,
              until: Callable[[list[Record]], bool] | None = None, limit_s: float | None = None) -> LabPhase:
    """Reset the caches, route with `policy`, replay the seeded Locust workload (kvlab.run.phases);
    with `min_requests`, the phase also runs until that many completed (as `kvlab lab`'s), with
    `until` until that holds for its records (a scenario's condition: kvlab.scenarios.outage), at
    most `limit_s` (default 4 × `duration_s`).

    Writes <run>/phase-N-<policy>/ (requests.jsonl, summary.json, replica-samples.json, the
    engines' prefix-cache counters before/after) and returns load_phase() of it."""
    run = Path(stack.run_dir)
    number = 1 + max([int(p.name.split("-")[1]) for p in run.glob("phase-*-*") if p.name.split("-")[1].isdigit()],
                     default=0)
    spec = BenchSpec(workload=workload, params=params or {}, users=users, duration_s=duration_s, seed=seed,
                     model=stack.model or "kvlab-tiny", min_requests=min_requests, limit_s=limit_s,
                     trace_sample_ratio=stack.topology.observability.sample_ratio if stack.topology else 1.0)
    display = _Display(stack)
    stack_ = AttachedStack(stack)
    before = replica_metrics(stack)   # counters only grow: a reset or a gateway start does not move them
    try:
        stack_.start()
        (result,) = run_phases(stack_, spec, [Phase(policy, policy)], run, display, first=number, until=until)
    finally:
        stack_.stop()
    after = replica_metrics(stack)
    engines = {name: {k: after[name][k] - before.get(name, {}).get(k, 0.0) for k in ("queries", "hits")}
               for name in after}
    samples = display.progress.samples if display.progress is not None else []
    write_json(result.dir / "replica-samples.json", {"samples": samples, "engine_prefix_cache": engines})
    return load_phase(result.dir)


def load_phase(out: Path) -> LabPhase:
    """One phase folder (phase-N-<name>/) read back."""
    extra = json.loads((out / "replica-samples.json").read_text()) if (out / "replica-samples.json").exists() else {}
    summary = read_summary(out / "summary.json")
    name = summary.phase or out.name.split("-", 2)[-1]
    return LabPhase(phase=Phase(name, summary.policy or name), dir=out, summary=summary,
                    records=read_records(out / "requests.jsonl"), samples=extra.get("samples", []),
                    engines=extra.get("engine_prefix_cache", {}))


def phase(stack: StackInfo, policy: str, **kw: Any) -> LabPhase:
    """The stack's latest phase with `policy` if the run has one with the same workload, seed,
    users and duration; else run it now (run_phase)."""
    found = phase_dir(stack, policy)
    if found is not None:
        earlier = load_phase(found)
        s = earlier.summary
        wanted = (kw.get("workload", "shared-prefix"), kw.get("seed", 0), kw.get("users", QUICK_USERS),
                  kw.get("duration_s", QUICK_DURATION_S))
        if (s.workload, s.seed, s.users, s.configured_duration_s) == wanted:
            print(f"using {found.relative_to(stack.run_dir)} from an earlier notebook (same workload, seed, users)")
            return earlier
    return run_phase(stack, policy, **kw)


def run_env() -> dict[str, Any]:
    """What the environment check of 00 prints: python, kvlab, optional binaries."""
    from shutil import which

    import kvlab

    return {"python": sys.executable, "kvlab": getattr(kvlab, "__version__", "?"),
            "runs": str(runs_root()),
            **{b: which(b) for b in ("prometheus", "jaeger", "chromium", "kind", "kubectl", "docker")}}


# ---- traces ----------------------------------------------------------------------------------------
def wait_trace(stack: StackInfo, trace_id: str, spans: tuple[str, ...] = (n.SPAN_SCHEDULE, n.SPAN_ENGINE_REQUEST),
               timeout_s: float = 20.0) -> Any:
    """The trace `trace_id` once it holds every span named in `spans`, a name listed twice as two
    spans (each process's exporter batches for ~5 s: one service's spans can come in before another's)."""
    from kvlab.errors import KvlabError
    from kvlab.traces.sources import open_source

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            trace = open_source(run_dir=Path(stack.run_dir), jaeger=stack.jaeger).trace(trace_id)
            if all(len(trace.find(s)) >= k for s, k in Counter(spans).items()):
                return trace
        except KvlabError:
            pass
        if time.monotonic() > deadline:
            raise StackError(f"trace {trace_id} did not arrive with spans {spans} within {timeout_s:.0f} s")
        time.sleep(0.5)


# ---- dashboards -------------------------------------------------------------------------------------
def dashboard_panel(prometheus: str, dashboard: Path, title: str, start: float, end: float, step_s: int = 2) -> Any:
    """One panel of a Grafana dashboard JSON (dashboards/*.json) as a plotly figure: its PromQL
    evaluated over [start, end] on `prometheus` the way Grafana would, one line per series."""
    import re

    import plotly.graph_objects as go

    from kvlab.dashboards.catalog import panel_queries
    from kvlab.dashboards.verify import grafana_expr, query_range

    data = json.loads(Path(dashboard).read_text())
    legends = {}
    for panel in _panels(data):
        for t in panel.get("targets") or []:
            legends[(panel.get("title"), t.get("refId"))] = t.get("legendFormat") or ""
    fig = go.Figure()
    queries = [(ref, expr) for panel_title, ref, expr in panel_queries(data) if panel_title == title]
    if not queries:
        raise StackError(f"no panel {title!r} in {dashboard}")
    for ref, expr in queries:
        promql = grafana_expr(expr, rate_interval_s=max(4, 4 * step_s), step_s=step_s,
                              range_s=max(1, int(end - start)))
        for series in query_range(prometheus, promql, start, end, step_s):
            labels = series["metric"]
            label = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m, labels=labels: labels.get(m.group(1), ""),
                           legends[(title, ref)])
            points = [(float(t) - start, float(v)) for t, v in series["values"]]
            fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines",
                                     name=label or ref))
    fig.update_layout(title=f"{data.get('title', '')} · {title}", template="plotly_white", height=340,
                      xaxis_title="seconds since the window started", margin=dict(l=60, r=20, t=50, b=40))
    return fig


def _panels(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in data.get("panels") or []:
        if panel.get("type") == "row":
            yield from _panels({"panels": panel.get("panels") or []})
        else:
            yield panel


# ---- whole scenarios ---------------------------------------------------------------------------------
def run_lab(args: list[str], label: str) -> Path:
    """`kvlab lab ARGS` into a new runs/<id>-<label> in a subprocess, with a live progress line
    (requests so far; the gateway's autoscale recommendation when it has one). If the cell fails
    or is interrupted the lab gets SIGINT and stops its own stack. Returns the run dir."""
    import signal

    from IPython.display import HTML, display

    from kvlab.stack.state import new_run_dir

    run = new_run_dir(label, runs_root())
    log = run / "lab.log"
    argv = [*KVLAB, "lab", *args, "--run-dir", str(run)]
    log.unlink(missing_ok=True)
    child = Child.start("kvlab-lab", argv, log, dict(os.environ, COLUMNS="110"))
    proc = child.popen
    attached.save_recorded(run, [child.describe()])
    handle = display(HTML(f"<b>kvlab lab {' '.join(args)}</b>: starting..."), display_id=True)  # type: ignore[no-untyped-call]  # IPython.display is untyped
    started = time.monotonic()
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            count = sum(p.read_bytes().count(b"\n") for p in run.glob("phase-*/requests.jsonl"))
            line = f"{time.monotonic() - started:.0f} s · {count} requests"
            stack = read_info(run)
            if stack and stack.gateway:
                try:
                    with urllib.request.urlopen(f"{stack.gateway}/debug/autoscale", timeout=1) as resp:
                        a = json.load(resp).get("recommendation") or {}
                    line += (f" · desired {a.get('desired', '–')} replicas ({a.get('reason', '')}), "
                             f"running {a.get('current', '–')}")
                except (OSError, ValueError):
                    pass
            if handle is not None:
                handle.update(HTML(f"<b>kvlab lab {' '.join(args)}</b>: {line}"))  # type: ignore[no-untyped-call]  # IPython.display is untyped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)      # KeyboardInterrupt in the lab: it stops its stack
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                child.stop()
        attached.save_recorded(run, [])
    if proc.returncode != 0:
        raise StackError(f"kvlab lab failed (exit {proc.returncode}); last lines of {log}:\n{log.read_text()[-3000:]}")
    return run
