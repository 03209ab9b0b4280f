"""Every child process kvlab starts (engines, gateways, the trace sink or Jaeger, Prometheus,
Locust, peers, the supervisor): `Child.start` is the one place a process is started, with its
argv, environment and log file, and `Child.stop` the one way it is stopped, by its pid.

A child runs in its own session with a log file by default, and gets SIGTERM from the kernel when
the kvlab process that started it dies, even by SIGKILL (Linux; only `kvlab up`'s supervisor is
started to outlive its starter). Stopping signals the child's process group (it leads one, so helpers
it spawned go too): SIGTERM, then SIGKILL after a grace period.
`stop_recorded` stops a process known only from stack.json, after checking that the pid is still
the recorded process (pids get reused): same start time, or for older records the same command
line (a child may rename itself, as vllm-router does, so the start time is what is kept).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgspec

from kvlab.errors import StackError
from kvlab.lifecycle import http_ok


def log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec so the kernel SIGTERMs it when its parent dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG); None where that cannot hold. The kernel ties it to the starting thread,
    so only a child started from the main thread (which lasts as long as the process) gets it;
    prctl is looked up here so the forked child only makes the call."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22); None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def own_record(name: str, log: str = "") -> ProcessRecord:
    """This process as stack.json records one."""
    argv = [c.decode(errors="replace") for c in Path("/proc/self/cmdline").read_bytes().split(b"\0") if c]
    return ProcessRecord(name=name, pid=os.getpid(), argv=argv, log=log, started=start_time(os.getpid()))


class ProcessRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A started process as stack.json (and a notebook's processes file) records it: enough to stop
    it later by pid, once `still_running` has checked the pid is still that process."""

    name: str
    pid: int
    argv: list[str]
    log: str = ""
    started: int | None = None   # `start_time` of pid (None in records of older versions)


class Child:
    """One supervised process: name, argv, log file, and its Popen (None if adopted by pid)."""

    def __init__(self, name: str, argv: list[str], log: Path, proc: subprocess.Popen[bytes] | None = None,
                 pid: int | None = None, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log, self.proc = name, [str(a) for a in argv], log, proc
        self.pid = proc.pid if proc is not None else int(pid or 0)
        self.env = env   # what it was started with, so it can be started again the same way

    @classmethod
    def start(cls, name: str, argv: list[str], log: Path | None, env: dict[str, str] | None = None, *,
              session: bool = True, die_with_parent: bool = True) -> Child:
        """Start `argv` with `env` (None: this process's), stdout and stderr appended to `log` (None:
        this process's stderr), stdin closed; in a session of its own unless `session` is False (a
        child that should get the terminal's Ctrl-C with its parent). `die_with_parent`: on Linux the
        kernel SIGTERMs it when the starting process dies (started from the main thread); False only
        for a process meant to outlive this one (`kvlab up`'s supervisor)."""
        fh: IO[bytes] | None = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            fh = open(log, "ab")  # noqa: SIM115 (closed below; the child keeps its own descriptor)
        try:
            pdeathsig = _die_with_parent() if die_with_parent else None
            proc = subprocess.Popen([str(a) for a in argv], stdout=fh or sys.stderr, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=session,
                                    preexec_fn=pdeathsig)  # noqa: PLW1509
        finally:
            if fh is not None:
                fh.close()
        return cls(name, argv, log or Path(os.devnull), proc, env=env)

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        """The process object of a child started here (not one adopted by pid)."""
        assert self.proc is not None, f"{self.name} was adopted by pid, not started here"
        return self.proc

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _alive(self.pid)

    def describe(self) -> ProcessRecord:
        return ProcessRecord(name=self.name, pid=self.pid, argv=self.argv, log=str(self.log),
                             started=start_time(self.pid))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL after `grace_s`; waits until it is gone."""
        if not self.alive():
            if self.proc is not None:
                self.proc.wait()
            return
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.alive():
            _signal_group(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        else:
            while _alive(self.pid):
                time.sleep(0.05)

    def fail(self, what: str) -> StackError:
        return StackError(f"{self.name} {what}; last lines of {self.log}:\n{log_tail(self.log)}")

    def wait_ready_file(self, path: Path, timeout_s: float) -> dict[str, Any]:
        """Wait for the JSON the child writes once it listens; StackError if it dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists():
                try:
                    data: dict[str, Any] = json.loads(path.read_text())
                    return data
                except ValueError:
                    pass
            if not self.alive():
                raise self.fail(f"exited with {self.proc.returncode if self.proc else '?'} before it was ready")
            time.sleep(0.05)
        raise self.fail(f"was not ready after {timeout_s:.0f} s")

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Poll `url` until it answers 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.fail("exited before it was healthy")
            if http_ok(url):
                return
            time.sleep(0.05)
        raise self.fail(f"not healthy at {url} after {timeout_s:.0f} s")


def runs_command(pid: int, argv: list[str]) -> bool:
    """True when `pid` is alive and its command line is `argv` (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return _alive(pid) and [c.decode(errors="replace") for c in cmdline if c] == [str(a) for a in argv]


def still_running(entry: ProcessRecord) -> bool:
    """The recorded process still runs: its pid alive with the recorded start time (or command line)."""
    if entry.started is not None:
        return _alive(entry.pid) and start_time(entry.pid) == entry.started
    return runs_command(entry.pid, entry.argv)


def stop_recorded(entry: ProcessRecord, grace_s: float = 10.0) -> bool:
    """Stop a process recorded in stack.json if it still runs; True if it was stopped."""
    if not still_running(entry):
        return False
    Child(entry.name, entry.argv, Path(entry.log), pid=entry.pid).stop(grace_s)
    return True
