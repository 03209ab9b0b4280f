"""The local stack acting on the gateway's desired-replica recommendation (docs/autoscaling.md).

Every `interval_s` it reads `GET <gateway>/debug/autoscale` and compares the recommendation with
the replicas it runs. Up: it starts one `kvlab engine` process per missing replica (one replica,
all its data-parallel ranks), waits until it listens, and adds its endpoints to the endpoints
file the gateway watches (`kvlab gateway --discovery file`). Down: it removes the newest replica
it added from that file first (no new requests), waits `drain_s` for the ones in flight, then
stops the process. The replicas the stack started with are the floor. Every action is a
`stack.scale` span, so a trace view shows load rising, the recommendation, the scale-up and the
effect on the same timeline.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import trace

from kvlab.contract import Endpoint
from kvlab.gateway.discovery.file import read_endpoints, write_endpoints
from kvlab.process import Child
from kvlab.telemetry import names

log = logging.getLogger(__name__)
tracer = trace.get_tracer("kvlab.stack")

# (replica name, ready-file path) -> argv of a one-replica engine process
ArgvFor = Callable[[str, Path], list[str]]
# called with the new endpoint list after every rewrite of the endpoints file (Prometheus targets)
OnChange = Callable[[list[Endpoint]], None]


@dataclass
class Scaled:
    name: str
    child: Child
    endpoints: list[Endpoint]


class Scaler:
    def __init__(self, gateway_url: str, endpoints_file: Path, argv_for: ArgvFor, run_dir: Path,
                 prefix: str = "scaled", env: dict[str, str] | None = None, interval_s: float = 1.0,
                 drain_s: float = 2.0, ready_timeout_s: float = 60.0, on_change: OnChange | None = None) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.endpoints_file = Path(endpoints_file)
        self.argv_for = argv_for
        self.run_dir = Path(run_dir)
        self.prefix = prefix
        self.env = env
        self.interval_s = interval_s
        self.drain_s = drain_s
        self.ready_timeout_s = ready_timeout_s
        self.on_change = on_change
        self.added: list[Scaled] = []
        self.actions: list[dict[str, Any]] = []         # what happened, for summaries and tests
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- state ---------------------------------------------------------------------------
    def current(self) -> int:
        """Replicas in the endpoints file (data-parallel ranks grouped into their replica)."""
        return len({e.replica or e.name for e in read_endpoints(self.endpoints_file)})

    def recommendation(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/debug/autoscale", timeout=2) as resp:
                found: dict[str, Any] | None = json.loads(resp.read()).get("recommendation")
                return found
        except (OSError, ValueError) as exc:
            log.debug("no recommendation: %s", exc)
            return None

    # ---- one evaluation --------------------------------------------------------------------
    def step(self) -> str | None:
        """Act once on the current recommendation: "up", "down" or None."""
        rec = self.recommendation()
        if rec is None:
            return None
        current = self.current()
        desired = int(rec["desired"])
        if desired > current:
            self.scale_up(current, desired, rec.get("reason", ""))
            return "up"
        if desired < current and self.added:
            self.scale_down(current, rec.get("reason", ""))
            return "down"
        return None

    def scale_up(self, current: int, desired: int, reason: str) -> None:
        for n in range(current, desired):
            self._seq += 1
            name = f"{self.prefix}-{self._seq}"
            with tracer.start_as_current_span(names.SPAN_SCALE_ACTION, attributes={
                    names.SCALE_DIRECTION: "up", names.SCALE_FROM: n, names.SCALE_TO: n + 1,
                    names.SCALE_REPLICA: name, names.AUTOSCALE_REASON: reason}) as span:
                t0 = time.monotonic()
                ready = self.run_dir / f"ready-{name}.json"
                ready.unlink(missing_ok=True)
                child = Child.start(f"engine-{name}", self.argv_for(name, ready),
                                    self.run_dir / "logs" / f"engine-{name}.log", self.env)
                try:
                    info = child.wait_ready_file(ready, self.ready_timeout_s)
                except Exception:
                    child.stop()
                    raise
                eps = [Endpoint(**r) for r in info["replicas"]]
                self.added.append(Scaled(name, child, eps))
                self._write(read_endpoints(self.endpoints_file) + eps)
                ms = (time.monotonic() - t0) * 1000
                span.set_attribute(names.SCALE_READY_MS, round(ms, 1))
                self.actions.append({"t": time.time(), "direction": "up", "replica": name, "to": n + 1,
                                     "reason": reason, "ready_ms": round(ms, 1), "urls": [e.url for e in eps]})

    def scale_down(self, current: int, reason: str) -> None:
        victim = self.added.pop()
        with tracer.start_as_current_span(names.SPAN_SCALE_ACTION, attributes={
                names.SCALE_DIRECTION: "down", names.SCALE_FROM: current, names.SCALE_TO: current - 1,
                names.SCALE_REPLICA: victim.name, names.AUTOSCALE_REASON: reason}) as span:
            t0 = time.monotonic()
            gone = {e.name for e in victim.endpoints}
            self._write([e for e in read_endpoints(self.endpoints_file) if e.name not in gone])
            time.sleep(self.drain_s)   # the gateway stops routing to it within one poll; let requests finish
            victim.child.stop()
            ms = (time.monotonic() - t0) * 1000
            span.set_attribute(names.SCALE_READY_MS, round(ms, 1))
            self.actions.append({"t": time.time(), "direction": "down", "replica": victim.name,
                                 "to": current - 1, "reason": reason, "ready_ms": round(ms, 1),
                                 "urls": [e.url for e in victim.endpoints]})

    def _write(self, endpoints: list[Endpoint]) -> None:
        write_endpoints(self.endpoints_file, endpoints)
        if self.on_change is not None:
            self.on_change(endpoints)

    # ---- background loop ----------------------------------------------------------------------
    def start(self) -> Scaler:
        self._thread = threading.Thread(target=self._run, name="kvlab-scaler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # a failed scale action is logged, the run goes on
                log.exception("scaling action failed")

    def stop(self) -> None:
        """Stop the loop and every replica it added."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while self.added:
            self.added.pop().child.stop()
