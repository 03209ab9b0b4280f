"""Plumbing shared by the lab notebooks (labs/0*.ipynb); the teaching stays in the notebooks.

The only state shared between notebooks is the run directory: `ensure_stack` reuses the stack
runs/latest/stack.json describes when it is healthy (else starts one with `kvlab up`, or, for the
kind targets, writes a stack.json pointing at the cluster's published URLs), and every phase a
notebook runs lands in that run dir exactly where `kvlab lab` puts it (phase-N-<policy>/), so
`kvlab traces`, the report and the next notebook find it. Processes a notebook starts for itself
(a gateway with another policy, also added to Prometheus's targets) are recorded in <run>/notebook-processes.json and stopped by pid
when the cell ends, even when it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvlab.errors import StackError
from kvlab.lab import QUICK
from kvlab.lifecycle import http_ok
from kvlab.load.runner import run_bench
from kvlab.load.summary import read_jsonl
from kvlab.stack.local import HOST, KVLAB, free_port
from kvlab.stack.process import Child, stop_recorded
from kvlab.stack.state import read_stack, runs_dir, set_latest, write_json
from kvlab.telemetry import names as n

TARGETS = ("local", "kind-cpu", "kind-gpu")
QUICK_DURATION_S = QUICK["duration"]
QUICK_USERS = QUICK["users"]
KIND_URLS = {"jaeger": "http://127.0.0.1:30686", "prometheus": "http://127.0.0.1:30090",
             "grafana": "http://127.0.0.1:30300"}   # NodePorts kind/*.yaml publishes (docs/kind.md)
PROCESSES_FILE = "notebook-processes.json"


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


def _kvlab(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([*KVLAB, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, COLUMNS="120"))


def healthy(stack: dict[str, Any] | None) -> bool:
    """A running stack whose gateway (and, locally, every replica) answers /health."""
    if not stack or stack.get("status") not in ("running", None):
        return False
    urls = [stack["gateway"]] + [r["url"] for r in stack.get("replicas", [])]
    return all(http_ok(f"{u}/health", timeout_s=2.0) for u in urls)


def _topology_name(stack: dict[str, Any]) -> str | None:
    return (stack.get("topology") or {}).get("name")


def ensure_stack(target: str = "local", topology: str = "quickstart", timeout_s: float = 180.0) -> dict[str, Any]:
    """The stack of runs/latest when it is healthy and runs `topology`; else a fresh one.

    local: `kvlab up --topology T` (a different local topology still running is stopped first).
    kind-cpu / kind-gpu: the cluster must be deployed (docs/kind.md); this only records its URLs.
    """
    if target not in TARGETS:
        raise StackError(f"TARGET must be one of {', '.join(TARGETS)}, not {target!r}")
    root = runs_root()
    current = read_stack(root / "latest")
    if target != "local":
        return _kind_stack(target, topology, root, current)
    if current and current.get("target", "local") == "local" and healthy(current):
        if _topology_name(current) == topology:
            return current
    if current and current.get("target", "local") == "local" and current.get("status") != "stopped":
        stop_stack(Path(current["run_dir"]))     # another topology, or degraded: never leave orphans
    proc = _kvlab("up", "--topology", topology, "--timeout", str(timeout_s), timeout_s=timeout_s + 30)
    stack = read_stack(root / "latest")
    if proc.returncode != 0 or not healthy(stack):
        raise StackError(f"kvlab up failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return _wait_prometheus(stack)


def _wait_prometheus(stack: dict[str, Any], timeout_s: float = 20.0) -> dict[str, Any]:
    """`kvlab up` returns once the gateway is healthy; Prometheus (if installed) comes right after."""
    from shutil import which

    if which("prometheus") is None or stack["topology"]["observability"]["prometheus"] == "off":
        return stack
    deadline = time.monotonic() + timeout_s
    while not stack.get("prometheus") and time.monotonic() < deadline:
        time.sleep(0.3)
        stack = read_stack(Path(stack["run_dir"])) or stack
    return stack


def _kind_stack(target: str, topology: str, root: Path, current: dict[str, Any] | None) -> dict[str, Any]:
    if current and current.get("target") == target and _topology_name(current) == topology and healthy(current):
        return current
    from kvlab.stack.kind import cluster_target
    from kvlab.stack.state import new_run_dir

    run_dir = new_run_dir(target, root)
    stack = {"id": run_dir.name, "run_dir": str(run_dir), "status": "running", "target": target,
             "topology": {"name": topology}, "model": "kvlab-tiny" if target == "kind-cpu" else None,
             "policy": "kv-aware", "gateway": cluster_target("gateway"), "baseline": cluster_target("baseline"),
             "replicas": [], "otlp_endpoint": None, "traces_dir": None, **KIND_URLS, "processes": []}
    with urllib.request.urlopen(f"{stack['gateway']}/v1/models", timeout=10) as resp:
        stack["model"] = json.load(resp)["data"][0]["id"]      # the served name, whatever the target
    write_json(run_dir / "stack.json", stack)
    set_latest(run_dir)
    return stack


def stop_stack(run_dir: Path | None = None) -> None:
    """`kvlab down` for a local run dir (default runs/latest) plus any process a notebook recorded."""
    run = Path(run_dir) if run_dir else runs_root() / "latest"
    for entry in _recorded(run):
        stop_recorded(entry)
    _save_recorded(run, [])
    stack = read_stack(run)
    if stack and stack.get("target", "local") == "local":
        _kvlab("down", "--run-dir", str(run))


def _recorded(run: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run / PROCESSES_FILE).read_text())
    except (OSError, ValueError):
        return []


def _save_recorded(run: Path, entries: list[dict[str, Any]]) -> None:
    if run.exists():
        write_json(run / PROCESSES_FILE, entries)


def reset_caches(stack: dict[str, Any]) -> int:
    """POST /reset_prefix_cache on every local replica (a phase starts cold); returns how many.
    On kind the replicas sit behind Services: restart them (kubectl rollout restart) instead."""
    for r in stack.get("replicas", []):
        req = urllib.request.Request(f"{r['url']}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    return len(stack.get("replicas", []))


@contextmanager
def gateway(stack: dict[str, Any], policy: str) -> Iterator[str]:
    """Base URL of a gateway routing with `policy` in front of the stack's replicas.

    The stack's own gateway when its policy matches; locally, else, a `kvlab gateway` started for
    the duration of the `with` block (stopped by pid on exit). On kind, round-robin means the
    plain Service (`baseline`, kube-proxy) and kv-aware the kvlab gateway."""
    if stack.get("policy") == policy:
        yield stack["gateway"]
        return
    if stack.get("target", "local") != "local":
        if policy != "round-robin":
            raise StackError(f"on {stack['target']} the cluster serves round-robin (baseline) and "
                             f"{stack.get('policy')} (gateway), not {policy}")
        yield stack["baseline"]
        return
    run = Path(stack["run_dir"])
    port = free_port()
    ready = run / f"ready-gateway-{policy}.json"
    ready.unlink(missing_ok=True)
    g = stack["topology"]["gateway"]
    argv = [*KVLAB, "gateway", "--host", HOST, "--port", str(port), "--endpoints-file", str(run / "endpoints.json"),
            "--policy", policy, "--model", stack["model"], "--scrape-interval-ms", str(g["scrape_interval_ms"]),
            "--ready-file", str(ready)]
    if g.get("config"):
        argv += ["--config", g["config"]]
    if stack["topology"].get("tokenizer"):
        argv += ["--tokenizer", stack["topology"]["tokenizer"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_SERVICE_NAME"] = "kvlab-gateway"
    if stack.get("otlp_endpoint"):
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = stack["otlp_endpoint"]
    else:
        env["OTEL_TRACES_EXPORTER"] = "none"
    child = Child.start(f"gateway-{policy}", argv, run / "logs" / f"gateway-{policy}.log", env)
    _save_recorded(run, [*_recorded(run), child.describe()])
    try:
        child.wait_ready_file(ready, 60)
        url = f"http://{HOST}:{port}"
        child.wait_http(f"{url}/health", 60)
        _scrape(stack, f"{HOST}:{port}", add=True)
        yield url
    finally:
        child.stop()
        _save_recorded(run, [e for e in _recorded(run) if e["pid"] != child.pid])
        _scrape(stack, f"{HOST}:{port}", add=False)


def _scrape(stack: dict[str, Any], hostport: str, add: bool) -> None:
    """Add (remove) a gateway to the `gateway` job of the stack's Prometheus (file-based service
    discovery, no reload), so the dashboards show every policy a notebook ran."""
    from kvlab.stack.prometheus import targets_file, write_targets

    run = Path(stack["run_dir"])
    path = targets_file(run, "gateway")
    if not stack.get("prometheus") or not path.is_file():
        return
    targets = [t for group in json.loads(path.read_text()) for t in group.get("targets", [])]
    targets = [t for t in targets if t != hostport] + ([hostport] if add else [])
    write_targets(run, "gateway", targets)


# ---- engine metrics ---------------------------------------------------------------------------------
def replica_metrics(stack: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per local replica: running, waiting, kv_usage, prefix-cache queries and hits (vLLM names)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {n.VLLM_NUM_REQUESTS_RUNNING: "running", n.VLLM_NUM_REQUESTS_WAITING: "waiting",
              n.VLLM_KV_CACHE_USAGE: "kv_usage", n.VLLM_PREFIX_CACHE_QUERIES + "_total": "queries",
              n.VLLM_PREFIX_CACHE_HITS + "_total": "hits"}
    out: dict[str, dict[str, float]] = {}
    for r in stack.get("replicas", []):
        values = dict.fromkeys(wanted.values(), 0.0)
        try:
            with urllib.request.urlopen(f"{r['url']}/metrics", timeout=2) as resp:
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
        out[r["name"]] = values
    return out


# ---- phases --------------------------------------------------------------------------------------------
class _Progress:
    """An in-place progress bar in the notebook (plain text where there is no display)."""

    def __init__(self, label: str, total_s: float, stack: dict[str, Any]) -> None:
        from IPython.display import HTML, display

        self.label, self.total_s, self.stack, self._html = label, total_s, stack, HTML
        self.handle = display(HTML(self._render(0.0, [])), display_id=True)
        self.samples: list[dict[str, Any]] = []
        self._next = 0.0

    def _render(self, elapsed: float, records: list[dict[str, Any]]) -> str:
        ok = sorted(r["ttft_ms"] for r in records if not r.get("error") and r.get("ttft_ms") is not None)
        p50 = f"{ok[len(ok) // 2]:.0f} ms" if ok else "–"
        errors = sum(1 for r in records if r.get("error"))
        done = min(elapsed, self.total_s)
        return (f"<b>{self.label}</b> <progress value='{done:.1f}' max='{self.total_s:.1f}'></progress> "
                f"{done:.0f}/{self.total_s:.0f} s · {len(records)} requests · TTFT p50 {p50} · {errors} errors")

    def __call__(self, elapsed: float, records: list[dict[str, Any]]) -> None:
        if elapsed >= self._next:      # sample replica load about once a second
            self._next = elapsed + 1.0
            for name, m in replica_metrics(self.stack).items():
                self.samples.append({"t": round(elapsed, 2), "replica": name, **m})
            if self.handle is not None:
                self.handle.update(self._html(self._render(elapsed, records)))


def phase_dir(stack: dict[str, Any], policy: str) -> Path | None:
    """The newest phase-N-<policy>/ with a summary in the stack's run dir."""
    found = sorted(Path(stack["run_dir"]).glob(f"phase-*-{policy}/summary.json"),
                   key=lambda p: int(p.parent.name.split("-")[1]))
    return found[-1].parent if found else None


def run_phase(stack: dict[str, Any], policy: str, *, workload: str = "shared-prefix",
              params: dict[str, Any] | None = None, users: int = QUICK_USERS,
              duration_s: float = QUICK_DURATION_S, seed: int = 0) -> dict[str, Any]:
    """Reset the caches, route with `policy`, replay the seeded Locust workload (kvlab bench).

    Writes <run>/phase-N-<policy>/ (requests.jsonl, summary.json, replica-samples.json, the
    engines' prefix-cache counters before/after) and returns load_phase() of it."""
    run = Path(stack["run_dir"])
    number = 1 + max([int(p.name.split("-")[1]) for p in run.glob("phase-*-*") if p.name.split("-")[1].isdigit()],
                     default=0)
    out = run / f"phase-{number}-{policy}"
    reset_caches(stack)
    progress = _Progress(f"phase {number}: {policy}", duration_s, stack)
    with gateway(stack, policy) as url:
        before = replica_metrics(stack)
        run_bench(url, out, workload=workload, params=params, users=users, duration_s=duration_s, seed=seed,
                  model=stack["model"], phase=policy, policy=policy, otlp_endpoint=stack.get("otlp_endpoint"),
                  progress=progress)
        after = replica_metrics(stack)
    engines = {name: {k: after[name][k] - before.get(name, {}).get(k, 0.0) for k in ("queries", "hits")}
               for name in after}
    write_json(out / "replica-samples.json", {"samples": progress.samples, "engine_prefix_cache": engines})
    return load_phase(out)


def load_phase(out: Path) -> dict[str, Any]:
    """{"dir", "summary", "records", "samples", "engines"} of one phase folder."""
    extra = json.loads((out / "replica-samples.json").read_text()) if (out / "replica-samples.json").exists() else {}
    return {"dir": out, "summary": json.loads((out / "summary.json").read_text()),
            "records": read_jsonl(out / "requests.jsonl"), "samples": extra.get("samples", []),
            "engines": extra.get("engine_prefix_cache", {})}


def phase(stack: dict[str, Any], policy: str, **kw: Any) -> dict[str, Any]:
    """The stack's latest phase with `policy` if the run has one with the same workload, seed,
    users and duration; else run it now (run_phase)."""
    found = phase_dir(stack, policy)
    if found is not None:
        earlier = load_phase(found)
        s = earlier["summary"]
        wanted = {"workload": kw.get("workload", "shared-prefix"), "seed": kw.get("seed", 0),
                  "users": kw.get("users", QUICK_USERS), "configured_duration_s": kw.get("duration_s", QUICK_DURATION_S)}
        if all(s.get(k) == v for k, v in wanted.items()):
            print(f"using {found.relative_to(stack['run_dir'])} from an earlier notebook (same workload, seed, users)")
            return earlier
    return run_phase(stack, policy, **kw)


def run_env() -> dict[str, Any]:
    """What the environment check of 00 prints: python, kvlab, optional binaries."""
    from shutil import which

    import kvlab

    return {"python": sys.executable, "kvlab": getattr(kvlab, "__version__", "?"),
            "runs": str(runs_root()), **{b: which(b) for b in ("prometheus", "jaeger", "chromium", "kind", "kubectl", "docker")}}


# ---- traces ----------------------------------------------------------------------------------------
def wait_trace(stack: dict[str, Any], trace_id: str, spans: tuple[str, ...] = (n.SPAN_SCHEDULE, n.SPAN_ENGINE_REQUEST),
               timeout_s: float = 20.0) -> Any:
    """The trace `trace_id` once it holds every span named in `spans` (exporters batch for ~5 s)."""
    from kvlab.errors import KvlabError
    from kvlab.traces.sources import open_source

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            trace = open_source(run_dir=Path(stack["run_dir"]), jaeger=stack.get("jaeger")).trace(trace_id)
            if all(trace.find(s) for s in spans):
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
        promql = grafana_expr(expr, rate_interval_s=max(4, 4 * step_s), step_s=step_s, range_s=max(1, int(end - start)))
        for series in query_range(prometheus, promql, start, end, step_s):
            label = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: series["metric"].get(m.group(1), ""), legends[(title, ref)])
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
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=dict(os.environ, COLUMNS="110"))
    child = Child("kvlab-lab", argv, log, proc)
    _save_recorded(run, [child.describe()])
    handle = display(HTML(f"<b>kvlab lab {' '.join(args)}</b>: starting..."), display_id=True)
    started = time.monotonic()
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            count = sum(sum(1 for _ in open(p, "rb")) for p in run.glob("phase-*/requests.jsonl"))
            line = f"{time.monotonic() - started:.0f} s · {count} requests"
            stack = read_stack(run)
            if stack and stack.get("gateway"):
                try:
                    with urllib.request.urlopen(f"{stack['gateway']}/debug/autoscale", timeout=1) as resp:
                        a = json.load(resp).get("recommendation") or {}
                    line += f" · desired {a.get('desired', '–')} replicas ({a.get('reason', '')}), running {a.get('current', '–')}"
                except (OSError, ValueError):
                    pass
            if handle is not None:
                handle.update(HTML(f"<b>kvlab lab {' '.join(args)}</b>: {line}"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)      # KeyboardInterrupt in the lab: it stops its stack
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                child.stop()
        _save_recorded(run, [])
    if proc.returncode != 0:
        raise StackError(f"kvlab lab failed (exit {proc.returncode}); last lines of {log}:\n{log.read_text()[-3000:]}")
    return run
