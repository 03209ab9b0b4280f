"""Shared pytest fixtures and the CI rule: under CI=true a test that needs an installed part
(vLLM, Prometheus, Chromium) fails instead of skipping, so CI can never pass by skipping."""

from __future__ import annotations

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


def require_binary(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"the `{name}` binary on PATH")
    return path  # type: ignore[return-value]




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
