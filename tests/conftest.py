"""Shared pytest fixtures and the suite's rules:
- under CI=true a test that needs an installed part (vLLM, Prometheus, Chromium) fails instead of
  skipping, so CI can never pass by skipping;
- the tiers: a test that starts a child process is marked `processes` (or slow, vllm, browser,
  prometheus, which imply it), or it fails here; `make test-fast` runs the rest (docs/development.md);
- the budget: the run's total and the slowest tests are printed against the suite's budget."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvlab.lifecycle import free_port

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require(condition: bool, what: str) -> None:
    """Skip (locally) or fail (in CI) when a needed part is missing."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI must provide {what}")
        pytest.skip(f"needs {what}")


# kubernetes-validate re-reads its schema files on every validate(), its multi-MB definitions file
# included: 35 s of test_manifests alone. Each file is read once per test process instead.
try:
    import kubernetes_validate.utils as _kubernetes_validate
    _kubernetes_validate.schema_contents = functools.cache(_kubernetes_validate.schema_contents)
except ImportError:       # the modules that need it say so (fail in CI, skip locally)
    pass


def require_binary(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"the `{name}` binary on PATH")
    return path  # type: ignore[return-value]


# ---- tiers: the fast tier starts no process -----------------------------------------------------
PROCESS_MARKS = ("processes", "slow", "vllm", "browser", "prometheus")
_running: list[pytest.Item] = []          # the test whose setup, call or teardown runs now
_popen_init = subprocess.Popen.__init__


def _starts_processes(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in PROCESS_MARKS)


def _guarded_popen_init(self, *args, **kwargs) -> None:
    if _running and not _starts_processes(_running[-1]):
        argv = args[0] if args else kwargs.get("args")
        pytest.fail(f"{_running[-1].nodeid} starts a process ({str(argv)[:120]}) but is not marked: add "
                    "`pytestmark = pytest.mark.processes` to its module (or mark the test) so that "
                    "`make test-fast` leaves it out", pytrace=False)
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init   # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


# The longest modules, measured (docs/development.md), longest first: `make test` (pytest-xdist,
# --dist loadfile: a module stays on one worker, so its module-scoped fixtures start once) hands them
# to the workers first, so that no long module starts last (--no-loadscope-reorder keeps this order).
LONGEST_FIRST = ("test_notebooks_experiments", "test_notebooks_topologies_a", "test_notebooks_topologies_b",
                 "test_notebooks_topologies_c",
                 "test_lab", "test_notebooks", "test_faults", "test_observability_lab", "test_notebooks_kind",
                 "test_compare", "test_compare_cluster", "test_vllm", "test_autoscaling_lab", "test_outage_lab",
                 "test_tokenization_vllm", "test_fuzz")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(item) and not item.get_closest_marker("processes"):
            item.add_marker("processes")       # so that `-m "not processes"` is the whole fast tier
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))     # stable: the rest keeps its order


# ---- the budget ---------------------------------------------------------------------------------
BUDGET_S = 20 * 60          # the whole suite on a 2-core machine (docs/development.md)
_started = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    took = time.monotonic() - _started
    tests = [r for key in ("passed", "failed", "error") for r in terminalreporter.stats.get(key, [])
             if getattr(r, "when", "call") == "call"]
    if not tests:
        return
    line = f"test time {took:.0f} s for {len(tests)} tests; the suite's budget is {BUDGET_S} s on 2 cores"
    terminalreporter.write_sep("=", line, red=took > BUDGET_S, green=took <= BUDGET_S)

@pytest.fixture(scope="session", autouse=True)
def _sdk_tracer_provider() -> None:
    """OTel allows one global TracerProvider per process, and in-process servers of every module share
    this one: make it the SDK's before any module asks, so that a module adding its in-memory
    exporter (`configure_tracing(extra=...)`) works after one whose server asked for kvlab's span
    recorder, in whatever order pytest-xdist hands the modules to this worker."""
    from opentelemetry.sdk.trace import SpanProcessor

    from kvlab.telemetry.setup import configure_tracing

    configure_tracing("kvlab-tests", extra=SpanProcessor())


@pytest.fixture(scope="module")
def runs_dir() -> Iterator[Path]:
    """A notebook test module's own runs dir (tests/notebook_runs.py); its processes are stopped by
    pid when the module ends."""
    from notebook_runs import _runs_env

    with _runs_env("kvlab-nb-") as runs:
        yield runs


@pytest.fixture
def port() -> int:
    return free_port()


@contextmanager
def sim_process(tmp: Path, *flags: str, stdout: int = subprocess.DEVNULL,
                timeout_s: float = 60.0) -> Iterator[tuple[subprocess.Popen, dict]]:
    """`kvlab engine sim FLAGS` in a subprocess (no trace export); yields (process, its ready JSON).
    Stopped by its pid on exit: SIGTERM, SIGKILL after 15 s; `proc.returncode` tells how it ended."""
    ready = tmp / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "engine", "sim", *flags, "--ready-file", str(ready)],
                            stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            assert proc.poll() is None, f"simulator exited: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "simulator did not become ready"
            time.sleep(0.05)
        yield proc, json.loads(ready.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class FakeHandler(BaseHTTPRequestHandler):
    """Base of the small HTTP fakes tests serve (a Jaeger, an OTLP receiver): quiet, one `reply`."""

    def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve `handler` on a free loopback port in a thread; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def span_role(span) -> str:
    """kvlab's role name of an SDK span: GenAI spans are named `{operation} {model}` and carry
    their role as `kvlab.span.role` (docs/tracing.md); the others are named by it."""
    from kvlab.telemetry import names

    return span.attributes.get(names.SPAN_ROLE, span.name)


def phase_result(name: str, records: list, summary=None, **kw):
    """A finished phase as the report takes it (summary from the records unless given)."""
    from kvlab.load.summary import summarize
    from kvlab.run.phases import Phase, PhaseResult

    return PhaseResult(phase=Phase(name, name), dir=Path("."), records=records,
                       summary=summarize(records) if summary is None else summary, **kw)


def stop_everything(runs: Path) -> list[str]:
    """Stop, by recorded pid, every stack under `runs` (stack.json: supervisor, processes; a notebook's
    own runs); returns the processes still alive after. For a kvlab command a test had to kill."""
    from kvlab.process import still_running, stop_recorded
    from kvlab.stack.attached import recorded
    from kvlab.stack.base import read_info

    entries = []
    for stack_file in runs.rglob("stack.json"):
        run = stack_file.parent
        stack = read_info(run)
        if stack is None:
            continue
        entries += recorded(run)
        if stack.supervisor is not None:
            entries.append(stack.supervisor)
        entries += list(reversed(stack.processes))
    for e in entries:
        stop_recorded(e, grace_s=60 if e.name == "supervisor" else 10)
    return [f"{e.name} {e.pid}" for e in entries if still_running(e)]


# ---- one `kvlab lab --quick` for the whole session ----------------------------------------------
QUICK_LAB_TIMEOUT_S = 320       # ~90 s alone; beside three xdist workers on 2 cores up to ~200 s


@dataclass(frozen=True)
class QuickLab:
    """`kvlab lab --quick` as a user runs it (no flags; KVLAB_RUNS_DIR; its own working dir): exit
    status, console, the run dir `runs/latest` names, and its wall-clock window (epoch seconds)."""

    returncode: int | None          # None: killed at QUICK_LAB_TIMEOUT_S
    stdout: str
    stderr: str
    run_dir: str
    started: float
    ended: float


def _run_quick_lab(root: Path) -> QuickLab:
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KVLAB_RUNS_DIR=str(root / "runs"))
    started = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "lab", "--quick"], env=env, cwd=root,
                              capture_output=True, text=True, timeout=QUICK_LAB_TIMEOUT_S)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired:
        stop_everything(root / "runs")
        code, out, err = None, "", f"`kvlab lab --quick` ran past {QUICK_LAB_TIMEOUT_S} s"
    return QuickLab(code, out, err, str((root / "runs" / "latest").resolve()), started, time.time())


@pytest.fixture(scope="session")
def quick_lab(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> QuickLab:
    """One quick lab read by every module that checks such a run (test_lab, test_observability_lab,
    test_genai_spans, test_twin_fidelity): under pytest-xdist the first worker to ask runs it, holding a file lock in
    the session's shared temp dir, and the others wait and read its result (one ~100-s run, not three)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / "quick-lab"
    result = root / "quick-lab.json"
    with FileLock(f"{root}.lock"):
        if not result.exists():
            lab = _run_quick_lab(root)
            result.write_text(json.dumps(asdict(lab)))
    return QuickLab(**json.loads(result.read_text()))
