"""How kvlab's server processes live and die, in one place.

A server (simulator, gateway, trace sink, vLLM launcher) runs on uvloop when it is installed,
announces readiness as one JSON line on stdout and in an atomically written ready file (so a
parent polling the file never reads half of it), and serves until SIGTERM or SIGINT. A parent
stops a child with SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from kvlab.errors import StackError


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write a file so readers see either the old content or all of the new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, target)


_HANDED_OUT: deque[int] = deque(maxlen=4096)   # ports this process gave out and may not bind yet


def _ephemeral_start() -> int:
    """The first port of the range the OS gives outgoing connections (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PICK = random.SystemRandom()   # not `random`'s global state: a seeded notebook would repeat its picks
# Ports any kvlab process on this machine handed out lately, one empty file each: another process
# drawing at the same moment (a second test worker's stack, a second lab) would otherwise find the
# same port free before either child bound it (a P/D simulator once failed so, on its KV-event port)
_CLAIMS = Path(tempfile.gettempdir()) / f"kvlab-ports-{getattr(os, 'getuid', lambda: 0)()}"
CLAIM_S = 120.0     # long enough for a stack to start the children it drew ports for


def _claim(port: int) -> bool:
    """Claim `port` machine-wide for CLAIM_S; False if another kvlab process claimed it lately. An
    unusable claims folder (read-only temp dir) claims nothing: this process's own record remains."""
    path = _CLAIMS / str(port)
    try:
        _CLAIMS.mkdir(exist_ok=True)
        try:
            if time.time() - path.stat().st_mtime < CLAIM_S:
                return False
            path.unlink()                   # a stale claim
        except FileNotFoundError:
            pass
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:                 # claimed between our look and our create
        return False
    except OSError:
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, not handed out before by this process nor lately by another
    kvlab process (`_claim`); the caller binds it soon after. It is drawn below the OS's ephemeral
    range: a port the OS picks (bind to 0) is also one it may give the next outgoing connection's
    local end, and on a busy machine one did take such a port before the simulator bound it.
    Without room below that range, the OS picks."""
    top = _ephemeral_start()
    for _ in range(64):
        port = _PICK.randrange(max(1024, top - 12000), top) if top > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue                    # in use (or lingering): draw again
            bound: int = s.getsockname()[1]
        if bound not in _HANDED_OUT and _claim(bound):
            _HANDED_OUT.append(bound)
            return bound
    raise StackError(f"no free TCP port on {host} that this process has not handed out already")


GC_GEN0_ENV = "KVLAB_GC_GEN0"
GC_GEN0_DEFAULT = 50_000


def settle_gc() -> None:
    """Tune the cyclic GC for serving, once start-up is over (announce_ready calls it).

    What start-up built (modules, tokenizer, policy, app) lives as long as the process, yet every
    gen-2 collection would walk it again: `gc.freeze()` moves it out of the collector's sight. A
    request allocates thousands of short-lived containers (more with tracing on: spans, attribute
    dicts, contexts), so the interpreter's gen-0 threshold of 700 ran a collection every request
    or so; `KVLAB_GC_GEN0` (default 50,000; 0 leaves the interpreter's settings) raises it. Cycles
    are still collected, in fewer, larger passes (docs/benchmarks.md, "Tracing cost": CPU and RSS).
    """
    try:
        gen0 = int(os.environ.get(GC_GEN0_ENV, GC_GEN0_DEFAULT))
    except ValueError:
        gen0 = GC_GEN0_DEFAULT
    if gen0 <= 0:
        return
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)   # else extension modules see their objects leak at exit (nanobind says so)
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)


def announce_ready(info: Any, ready_file: str | Path | None = None) -> None:
    """Print `info` as one JSON line and, if asked, write it to `ready_file` atomically; start-up
    is over, so the GC is settled for serving (`settle_gc`)."""
    settle_gc()
    line = json.dumps(info)
    print(line, flush=True)
    if ready_file:
        write_atomic(ready_file, line + "\n")


async def stop_requested() -> None:
    """Return when the process receives SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has finished unwinding."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run a server's main coroutine, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def terminate(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Stop a child: SIGTERM, then SIGKILL if it is still running after `grace_s`; always reaped."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status: int = resp.status
            return status == 200
    except OSError:
        return False


def wait_http(url: str, proc: subprocess.Popen[Any] | None = None, timeout_s: float = 30.0) -> None:
    """Poll `url` until it answers 200; StackError if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            args = proc.args
            program = args[0] if isinstance(args, Sequence) and not isinstance(args, (str, bytes)) else args
            raise StackError(f"{Path(str(program)).name} exited with {proc.returncode} before {url} was ready")
        if http_ok(url, timeout_s=2.0):
            return
        time.sleep(0.1)
    raise StackError(f"{url} not ready after {timeout_s:.0f} s")
