"""The policies of one `kvlab twin` run side by side, one process each.

A twin run is one core's work from its start to its end (one event loop in virtual time), and the
policies of a comparison never share state: on a machine with two cores, `--policies
round-robin,kv-aware` takes about as long as its slower policy, not as long as both. Each run is
forked (its plan, the parsed trace and everything already imported come along), reports its progress
through a pipe and sends its result back; the figures are the ones a run in this process gives.
Ctrl-C or SIGTERM reaches every run in progress, and each sends what had finished (summary marked
partial), as a run in this process does; a run that dies (out of memory) is named, never waited on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkProcess
from types import FrameType
from typing import Any, cast

from kvlab.errors import TwinError
from kvlab.twin.feed import Feed
from kvlab.twin.runner import Interrupt, Stopped, TwinResult, run
from kvlab.twin.settings import Plan

Progress = Callable[[int, float], None]
REPORT_EVERY_S = 0.1   # a run's progress reaches the bar this often
MAX_DEFAULT_JOBS = 4    # each run holds its own memory (16 x 10,000 conversation requests: ~0.8 GB)
_FORKS = "fork" in multiprocessing.get_all_start_methods()   # not on Windows


def default_jobs() -> int:
    """Runs at once unless told: one per core this process may run on, at most `MAX_DEFAULT_JOBS`
    (1 where processes cannot be forked)."""
    if not _FORKS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, MAX_DEFAULT_JOBS)


@dataclass(slots=True)
class Runs:
    """Every plan's result that ran, in plan order (a stopped run's part, its summary marked partial),
    and why the runs ended early (None: every one finished)."""

    results: list[TwinResult]
    why: str | None = None
    cause: BaseException | None = None   # KeyboardInterrupt, Interrupt (SIGTERM) or TwinError


def run_all(plans: Sequence[Plan], oracle: bool, progress: Callable[[Plan], Progress], jobs: int) -> Runs:
    """Run every plan, `jobs` at a time in processes of their own (1, or no fork on this platform:
    one after another in this process); `progress(plan)` makes a plan's progress callback as it
    starts. After a stop no further plan starts; the ones running finish (interrupted, stop too)."""
    if not plans:
        return Runs([])
    # one feed for all (the plans share their workload): the tokenizer loads once, before any fork
    feed = Feed(plans[0].workload)
    if jobs <= 1 or len(plans) <= 1 or not _FORKS:
        return _one_by_one(plans, oracle, progress, feed)
    return _side_by_side(plans, oracle, progress, jobs, feed)


def _one_by_one(plans: Sequence[Plan], oracle: bool, progress: Callable[[Plan], Progress], feed: Feed) -> Runs:
    out = Runs([])
    for plan in plans:
        try:
            out.results.append(run(plan, oracle=oracle, feed=feed, progress=progress(plan)))
        except Stopped as exc:
            out.results.append(exc.result)
            out.why, out.cause = exc.why, exc.__cause__
            break
    return out


@dataclass(slots=True)
class _Run:
    index: int
    plan: Plan
    process: ForkProcess
    conn: Connection
    update: Progress


def _side_by_side(plans: Sequence[Plan], oracle: bool, progress: Callable[[Plan], Progress], jobs: int,
                  feed: Feed) -> Runs:
    ctx = multiprocessing.get_context("fork")
    todo = list(enumerate(plans))
    runs: dict[Connection, _Run] = {}
    done: dict[int, TwinResult] = {}
    out = Runs([])
    stop: list[int] = []   # the Ctrl-C or SIGTERM this command got, acted on between reads
    forwarded = False
    try:
        with _signals_noted(stop):
            while todo or runs:
                while todo and len(runs) < jobs and out.why is None and not stop:
                    i, plan = todo.pop(0)
                    reader, writer = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_child, args=(writer, plan, oracle, feed),
                                       name=f"twin {plan.policy.name}", daemon=True)
                    proc.start()
                    writer.close()   # the child's end: its exit is the reader's EOF
                    runs[reader] = _Run(i, plan, proc, reader, progress(plan))
                if stop and not forwarded:
                    # every run still going stops and sends its part (a terminal's Ctrl-C reached
                    # them already: a run acts on the first signal it gets and ignores the rest)
                    forwarded = True
                    for r in runs.values():
                        os.kill(cast(int, r.process.pid), signal.SIGTERM)
                if runs:
                    _receive(runs, done, out, stopping=bool(stop))
    finally:
        for r in runs.values():   # only after a second Ctrl-C or a failed run
            r.process.kill()
            r.process.join()
            r.conn.close()
    if stop:
        cause: BaseException = KeyboardInterrupt() if stop[0] == signal.SIGINT else Interrupt("SIGTERM")
        out.why, out.cause = f"stopped by {type(cause).__name__}", cause
    out.results = [done[i] for i in sorted(done)]
    return out


@contextlib.contextmanager
def _signals_noted(stop: list[int]) -> Iterator[None]:
    """Ctrl-C and SIGTERM are noted in `stop`, not raised, so no read of a pipe is cut in two; a
    second one raises (the runs are then killed, their parts lost). A Ctrl-C this process ignores
    (started in the background) stays ignored."""
    def note(signum: int, frame: FrameType | None) -> None:
        if stop:
            raise KeyboardInterrupt if signum == signal.SIGINT else Interrupt("SIGTERM")
        stop.append(signum)

    names = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
    try:
        old = {n: signal.signal(n, note) for n in names}
    except ValueError:   # not the main thread: no signal reaches this code
        yield
        return
    try:
        yield
    finally:
        for n, handler in old.items():
            signal.signal(n, handler)


def _receive(runs: dict[Connection, _Run], done: dict[int, TwinResult], out: Runs, stopping: bool) -> None:
    """Read what the runs sent (waiting a moment for one to send): progress, a result, a stop or an
    error. `stopping`: this command was stopped, so a run that ends without its part is let go."""
    for conn in wait(list(runs), timeout=REPORT_EVERY_S):
        r = runs[conn]   # type: ignore[index]   # wait() returns what it was given
        try:
            msg = r.conn.recv()
        except EOFError:   # the process ended without sending its result
            _end(runs, r)
            if not stopping and out.why is None:
                out.why = f"the {r.plan.policy.name} run ended without a result (exit code {r.process.exitcode})"
                out.cause = TwinError(out.why)
            continue
        kind = msg[0]
        if kind == "progress":
            r.update(msg[1], msg[2])
            continue
        _end(runs, r)
        if kind == "error":
            if not stopping:
                raise RuntimeError(f"the {r.plan.policy.name} run failed:\n{msg[1]}")
            continue
        result = TwinResult(r.plan, *msg[1])
        r.update(len(result.records), result.outcome.virtual_s)
        done[r.index] = result
        if kind == "stopped" and out.why is None and not stopping:
            out.why, out.cause = msg[2], _CAUSES[msg[3]](msg[2])


_CAUSES: dict[str, Callable[[str], BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt, "Interrupt": Interrupt, "TwinError": TwinError}


def _end(runs: dict[Connection, _Run], r: _Run) -> None:
    del runs[r.conn]
    r.conn.close()
    r.process.join()


def _child(conn: Connection, plan: Plan, oracle: bool, feed: Feed) -> None:
    """One plan's run in its own process: progress, then ("done" | "stopped", the result's parts)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # forked after the parent tokenized: no pool here
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _first_signal)
    signal.signal(signal.SIGTERM, _first_signal)
    last = [0.0]

    def report(n: int, virtual_s: float) -> None:
        now = time.monotonic()
        if now - last[0] >= REPORT_EVERY_S:
            last[0] = now
            conn.send(("progress", n, virtual_s))

    try:
        msg: tuple[Any, ...]
        try:
            msg = ("done", _parts(run(plan, oracle=oracle, feed=feed, progress=report)))
        except Stopped as exc:   # a signal (KeyboardInterrupt, Interrupt) or the watchdog (TwinError)
            msg = ("stopped", _parts(exc.result), exc.why, type(exc.__cause__).__name__)
        _ignore_signals()
        conn.send(msg)
    except BaseException:   # a bug in a run: the parent names it with this traceback
        _ignore_signals()
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _parts(r: TwinResult) -> tuple[Any, ...]:
    """A result less its plan (the parent has it)."""
    return r.summary, r.records, r.outcome, r.oracle, r.wall_s


def _first_signal(signum: int, frame: FrameType | None) -> None:
    """Stop the run on the first Ctrl-C or SIGTERM; ignore the rest (the parent forwards one too)."""
    _ignore_signals()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupt("SIGTERM")


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
