"""Run Locust headless in a subprocess (gevent stays out of asyncio processes) and summarize it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from kvlab.errors import StackError
from kvlab.lifecycle import terminate
from kvlab.load.measure import Record, record_of
from kvlab.load.spec import BenchSpec
from kvlab.load.stages import Stage, StageResult, results
from kvlab.load.summary import OpenLoop, Summary, open_loop, summarize
from kvlab.load.workloads.trace import Trace
from kvlab.process import Child
from kvlab.telemetry.sampling import ratio_env

LOCUSTFILE = Path(__file__).with_name("locustfile.py")  # not imported here: it loads gevent
RAMP_SHAPE = Path(__file__).with_name("ramp_shape.py")

Progress = Callable[[float, list[Record]], None]


class JsonlTail:
    """Reads the records appended to a requests.jsonl since the last call (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[Record] = []
        self._pos = 0
        self._partial = b""

    def poll(self) -> list[Record]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return self.records
        self._pos += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip() and (record := record_of(line)) is not None:
                self.records.append(record)
        return self.records


def locust_argv(target: str, out_dir: Path, spec: BenchSpec, run_time_s: float, phase: str = "",
                policy: str = "") -> list[str]:
    """Locust runs for `run_time_s`; with `spec.ramp`, the ramp shape decides the users over time
    (and when the test ends)."""
    ramp = spec.ramp
    files = str(LOCUSTFILE) if ramp is None else f"{LOCUSTFILE},{RAMP_SHAPE}"
    users = 1 if spec.open_loop else spec.users   # open loop: one user dispatches every send
    load = ["-u", str(users), "-r", str(spec.spawn_rate or users), "-t", f"{max(1, round(run_time_s))}s"] \
        if ramp is None else ["--ramp", ramp.to_json()]
    rate, process, time_scale = schedule(spec)
    return [sys.executable, "-m", "locust", "-f", files, "--headless", "--host", target, *load,
            "--stop-timeout", str(stop_timeout(spec, run_time_s)), "--csv", str(out_dir / "locust"), "--only-summary",
            "--html", str(out_dir / "locust.html"),
            "--loglevel", "WARNING", "--exit-code-on-error", "0",
            "--workload", spec.workload, "--workload-params", json.dumps(spec.params), "--seed", str(spec.seed),
            "--model", spec.model, "--phase", phase, "--policy", policy,
            "--requests-out", str(out_dir / "requests.jsonl"),
            "--rate", str(rate), "--arrival", process, "--time-scale", str(time_scale),
            *(["--stages", ",".join(f"{s.rate:g}:{s.duration:g}" for s in spec.stages)] if spec.stages else [])]


def stop_timeout(spec: BenchSpec, run_time_s: float) -> int:
    """Seconds Locust lets requests in flight finish after the run time: 5 for closed-loop users;
    an open loop's requests drain for up to the phase's length (as `vllm bench serve` waits for
    its requests), those still running then are recorded unfinished."""
    return max(5, round(run_time_s)) if spec.open_loop else 5


def schedule(spec: BenchSpec) -> tuple[float, str, float]:
    """Locust's --rate, --arrival and --time-scale for `spec` (0, 0: closed loop). A trace at a rate
    keeps its own timestamps' shape, scaled to that mean rate."""
    if spec.workload == "trace" and spec.open_loop:
        rate = Trace(seed=spec.seed, params=spec.params).rate
        return 0.0, "poisson", rate / spec.arrival.rate if spec.arrival is not None else (spec.time_scale or 1.0)
    if spec.arrival is not None:
        return spec.arrival.rate, spec.arrival.label, 0.0
    return 0.0, "poisson", 0.0


def per_stage(records: list[Record], stages: list[Stage]) -> list[StageResult]:
    """A live ramp's per-stage results: send times from the first scheduled send (the ramp's 0)."""
    t0 = min((r.ts for r in records), default=0.0)
    return results([msgspec.structs.replace(r, ts=r.ts - t0) for r in records], stages)


def offered(spec: BenchSpec, records: list[Record], duration_s: float) -> OpenLoop | None:
    """The open-loop part of a phase's summary (None for closed-loop users)."""
    if not spec.open_loop:
        return None
    rate, process, time_scale = schedule(spec)
    if time_scale:
        trace_rate = Trace(seed=spec.seed, params=spec.params).rate
        return open_loop(records, trace_rate / time_scale, "trace", round(time_scale, 6), duration_s)
    if spec.stages:   # the ramp's mean offered rate
        rate = sum(s.rate * s.duration for s in spec.stages) / sum(s.duration for s in spec.stages)
        process = "stages"
    return open_loop(records, rate, process, duration_s=duration_s)


def slow_part(records: list[Record], elapsed_s: float) -> str:
    """Which part of serving kept a phase from completing requests, from the requests that did."""
    ok = [r for r in records if not r.error]
    if not ok:
        errors = [r for r in records if r.error]
        return (f"every request failed ({errors[0].error})" if errors else
                f"no request finished in {elapsed_s:.0f} s: the engine's prefill and generation are too "
                "slow here (its log shows prompt and generation throughput)")
    ttft = float(np.median([r.ttft_ms for r in ok if r.ttft_ms is not None] or [0.0]))
    decode = float(np.median([r.e2e_ms - (r.ttft_ms or 0.0) for r in ok]))
    part = "prefill (time to first token)" if ttft >= decode else "generation (tokens after the first)"
    return (f"the engine's {part} is the slow part: TTFT p50 {ttft / 1000:.1f} s, "
            f"rest of a reply p50 {decode / 1000:.1f} s")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """Stop Locust early the way that still writes its reports: SIGINT (on SIGTERM it exits
    without the HTML report), then `terminate` if it has not finished within `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    terminate(proc)


def run_bench(target: str, out_dir: str | Path, spec: BenchSpec, *, phase: str = "", policy: str = "",
              otlp_endpoint: str | None = None, progress: Progress | None = None,
              until: Callable[[list[Record]], bool] | None = None) -> Summary:
    """Run one Locust load test; writes requests.jsonl, summary.json, locust_*.csv, locust.html,
    locust.log. With `spec.ramp`, users follow it (`users`/`duration_s` are then taken from it).

    With `spec.min_requests`, short of the minimum when the limit is reached it writes
    summary.json and raises StackError naming the slow part. With `until`, the phase also runs
    until it holds for the records so far (at most the limit; a scenario's own condition)."""
    users, duration_s, min_requests = spec.users, spec.duration_s, spec.min_requests
    if spec.ramp is not None:
        users, duration_s = spec.ramp.peak, spec.ramp.duration_s
        min_requests = 0
    bounded = bool(min_requests) or until is not None
    limit_s = max(spec.limit_s or 4 * duration_s, duration_s) if bounded else duration_s
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "requests.jsonl"
    jsonl.unlink(missing_ok=True)
    env = dict(os.environ, OTEL_SERVICE_NAME="kvlab-locust", **ratio_env(spec.trace_sample_ratio))
    if otlp_endpoint:   # else the user's own OTEL_* settings, if any, apply (kvlab bench)
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    # Locust's own run time is the hard limit; the minimum is checked here, and met, Locust is stopped
    argv = locust_argv(target, out, msgspec.structs.replace(spec, users=users), limit_s, phase, policy)
    tail = JsonlTail(jsonl)
    start = time.monotonic()
    # the phase's clock starts with Locust's test (it opens requests.jsonl then), not with its start-up,
    # which a busy machine makes long: the minimum and the limit are counted from there
    began: float | None = None
    (out / "locust.log").unlink(missing_ok=True)
    proc = Child.start("locust", argv, out / "locust.log", env, session=False).popen   # Ctrl-C reaches it too
    try:
        deadline = start + limit_s + stop_timeout(spec, limit_s) + 60
        while proc.poll() is None:
            if began is None and jsonl.exists():
                began = time.monotonic()
            elapsed, records = (0.0 if began is None else time.monotonic() - began), tail.poll()
            if time.monotonic() > deadline:
                raise StackError(f"locust did not finish in time; see {out / 'locust.log'}")
            if progress:
                progress(elapsed, records)
            if bounded and elapsed >= duration_s and (elapsed >= limit_s or (
                    sum(1 for r in records if not r.error) >= min_requests and (until is None or until(records)))):
                break
            time.sleep(0.25)
    finally:
        stop(proc)
    records = tail.poll()
    ran_s = time.monotonic() - (start if began is None else began)
    if progress:
        progress(ran_s, records)
    if proc.returncode != 0 and not records:
        log_tail = (out / "locust.log").read_text(errors="replace")[-2000:]
        raise StackError(f"locust exited with {proc.returncode}:\n{log_tail}")
    summary = msgspec.structs.replace(
        summarize(records, spec.slo, duration_s if spec.open_loop else 0.0),
        open_loop=offered(spec, records, duration_s), phase=phase, policy=policy, target=target,
        users=None if spec.open_loop else users, seed=spec.seed,
        workload=spec.workload, workload_params=spec.params, configured_duration_s=duration_s,
        min_requests=min_requests, limit_s=limit_s if min_requests else None,
        stages=per_stage(records, spec.stages) if spec.stages else None)
    (out / "summary.json").write_text(summary.to_json())
    if min_requests and summary.ok < min_requests:
        raise StackError(f"phase {phase or policy or '?'} completed {summary.ok} of the {min_requests} requests "
                         f"it needs within its {limit_s:.0f}-s limit: "
                         f"{slow_part(records, ran_s)}")
    return summary
